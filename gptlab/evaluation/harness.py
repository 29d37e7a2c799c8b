"""lm-evaluation-harness on gptlab models: `GptlabLM` (lm-eval's model "gptlab") and `run_tasks`.

Why an adapter of our own: a gptlab checkpoint or run is not a transformers model, so lm-eval's `hf` backend
cannot read it; but the `hf` backend's numbers are the ones everybody quotes, so on a model both can load this
adapter must give the same numbers. Every choice that moves a score follows that backend:

* Tokens. Text is encoded as transformers encodes it: special-token text is the special token, and a tokenizer
  whose post-processor puts BOS first (Llama's) gets BOS, although gptlab's own `encode` never adds it. The
  context / continuation split is lm-eval's `TemplateLM._encode_pair` (inherited): trailing spaces of the
  context move to the continuation, and the continuation is what the pair's encoding holds past the context's.
  An empty context becomes the prefix token (BOS, else end-of-text).
* Context. A request longer than `max_length` (default: the model's block_size) loses tokens on the left;
  `loglikelihood_rolling` scores a document in disjoint windows (lm-eval's `get_rolling_token_windows`), each
  token predicted once.
* Batches. Requests go longest first (lm-eval's `Collator`), so a batch's rows have similar lengths and little
  padding; rows are right-padded, which a causal model never attends to, and only the continuation positions go
  through the LM head (a (batch, T, vocab) logits tensor would be most of the memory).
* Generation runs on gptlab's `Engine` (KV-cached, batched): greedy unless the task samples, rows end at the
  end-of-text token or a stop string, and the text is decoded and cut as the `hf` backend does (special tokens
  dropped, cut at the first stop string).

lm-eval 0.4 has no plugin entry point for models: its command line knows only its built-in names. Importing this
module registers "gptlab"; `python -m gptlab.evaluation.harness ...` is lm-eval's own command line with it
registered, and `gptlab eval MODEL --tasks ...` calls `run_tasks`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gptlab.errors import GptlabError
from gptlab.evaluation.tasks import continuation_scores
from gptlab.generation import Engine, SamplingParams, cache_length
from gptlab.hardware import resolve_device, weights_dtype
from gptlab.loading import load_model

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

logger = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256  # as lm-eval's hf backend
Request = tuple[Any, list[int], list[int]]  # (cache key, context tokens, continuation tokens)


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype model_arg ("bfloat16", a torch.dtype); None and "auto" keep the checkpoint's."""
    return None if value == "auto" else weights_dtype(value, "dtype (or auto)")


def _positive_int(name: str, value: int | str | None, default: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise GptlabError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise GptlabError(f"{name} must be a positive integer, got {value!r}")
    return number


class GptlabLM(TemplateLM):
    """Any gptlab model path (run, checkpoint, Hugging Face directory) as an lm-eval model.

    model_args: pretrained=PATH, device (auto), dtype (the checkpoint's), batch_size (1), max_length (the
    model's block_size), max_gen_toks (256), add_bos_token (the tokenizer's own behaviour), quantize (int8 or
    int4, weight-only: `gptlab.quantize`) and group_size (int4's, default 32).
    """

    def __init__(
        self,
        pretrained: str | Path,
        device: str | None = "auto",
        dtype: str | torch.dtype | None = None,
        batch_size: int | str | None = 1,
        max_length: int | str | None = None,
        max_gen_toks: int | str | None = None,
        add_bos_token: bool | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it to every model; only "auto" batch sizes use it
        quantize: str | None = None,
        group_size: int | str | None = None,
    ) -> None:
        super().__init__()
        if str(batch_size).startswith("auto"):
            raise GptlabError("batch_size auto is not supported by the gptlab model: give a number")
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda:0 unless told otherwise; its hf backend then runs on the CPU
            logger.warning("device %s requested but CUDA is not available: using the CPU", device)
            device = "cpu"
        self._device = torch.device(resolve_device(device or "auto"))
        group_size = None if group_size is None else _positive_int("group_size", group_size, 0)
        model, tokenizer = load_model(pretrained, device=self._device, dtype=_dtype(dtype), quantize=quantize or None,
                                      group_size=group_size)
        if tokenizer is None:
            raise GptlabError(f"{pretrained} has no tokenizer: lm-eval tasks are text, so the model needs one")
        self._attach(model.eval(), tokenizer, str(pretrained), batch_size, max_length, max_gen_toks, add_bos_token)

    @classmethod
    def of_model(cls, model: torch.nn.Module, tokenizer: TextTokenizer, name: str, batch_size: int = 1) -> GptlabLM:
        """An lm-eval model over a model already in memory, e.g. a training run's (its mode is the caller's)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._device = next(model.parameters()).device
        lm._attach(model, tokenizer, name, batch_size, None, None, None)
        return lm

    def _attach(self, model: torch.nn.Module, tokenizer: TextTokenizer, name: str, batch_size: int | str | None,
                max_length: int | str | None, max_gen_toks: int | str | None, add_bos_token: bool | None) -> None:
        self.model, self.tok, self.pretrained = model, tokenizer, name
        block_size = model.config.block_size
        self.max_length = _positive_int("max_length", max_length, block_size)
        if self.max_length > block_size:
            raise GptlabError(f"max_length {self.max_length} is longer than the model's block_size {block_size}")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks, DEFAULT_MAX_GEN_TOKS)
        self.batch_size = _positive_int("batch_size", batch_size, 1)
        self.add_bos = tokenizer.adds_bos if add_bos_token is None else bool(add_bos_token)
        if self.add_bos and tokenizer.bos_id is None:  # else every request would hold a None id
            raise GptlabError(f"add_bos_token: {name}'s tokenizer has no BOS token to put first")
        self._special = {t for t in (tokenizer.eot_id, tokenizer.bos_id) if t is not None}

    # --- what TemplateLM and lm-eval ask of a model ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:  # None for a char tokenizer: generation then stops on `until` alone
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and a document's first window) starts from: BOS, else end-of-text, as in
        the hf backend. A tokenizer with neither (char) still scores contexts that are not empty."""
        token = self.tok.bos_id if self.tok.bos_id is not None else self.tok.eot_id
        if token is None:
            raise GptlabError(f"{self.pretrained}'s tokenizer has neither a BOS nor an end-of-text token: an empty "
                              "context, or a loglikelihood_rolling task, needs one to start from")
        return token

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        return {"model_num_parameters": self.model.num_parameters(),
                "model_dtype": str(next(self.model.parameters()).dtype)}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids as transformers gives them: special-token text is the special token, and BOS comes first
        when the tokenizer adds it (add_special_tokens=False: never)."""
        ids = self.tok.encode(string, allow_special=True)
        add = self.add_bos if add_special_tokens is None else add_special_tokens and self.add_bos
        if add and not (ids and ids[0] == self.tok.bos_id):  # a text that starts with BOS keeps just that one
            ids = [self.tok.bos_id, *ids]  # type: ignore[list-item]
        return ids

    # --- scoring --------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1] + r[2])))
        scores: list[tuple[float, bool]] = []
        for batch in collator.get_batched(n=self.batch_size):
            scores.extend(self._score_batch([(ctx, cont) for _, ctx, cont in batch]))
        scores = collator.get_original(scores)
        for (key, _, _), score in zip(requests, scores, strict=True):
            if key is not None:  # rolling windows have none: their sum is cached per document
                self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def _score_batch(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        return continuation_scores(self.model, pairs, self.max_length)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, over disjoint windows of max_length tokens."""
        windows: list[Request] = []
        owner: list[int] = []
        for i, (text,) in enumerate(r.args for r in requests):
            tokens = self.tok_encode(text)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -----------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string (`until`), end-of-text or `max_gen_toks` tokens."""
        collator = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                            group_by="gen_kwargs", group_fn=lambda a: a[1])
        texts: list[str] = []
        self._engine: Engine | None = None  # kept across batches: one KV cache, its rows reused
        try:
            for batch in collator.get_batched(n=self.batch_size):
                contexts, settings = zip(*batch, strict=True)
                texts.extend(self._generate(list(contexts), settings[0]))
        finally:
            self._engine = None
        texts = collator.get_original(texts)
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def _generate(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[str]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos = None if self.tok.eot_id is None else self.tok.decode([self.tok.eot_id])
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        until = [s for s in until if s]
        max_new = int(kwargs.pop("max_gen_toks"))
        room = self.max_length - max_new
        if room <= 0:
            raise GptlabError(f"max_gen_toks {max_new} leaves no room for a context in max_length "
                              f"{self.max_length}")
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        params = SamplingParams.from_fields(kwargs, max_new_tokens=max_new, temperature=temperature, stop=until)
        prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]
        need = cache_length(prompts, max_new)  # batches come longest first: the first one sizes the cache
        if self._engine is None or self._engine.max_len < min(need, self.model.config.block_size):
            self._engine = Engine(self.model, max_batch=self.batch_size, tokenizer=self.tok, max_len=need)
        gens = self._engine.run([self._engine.prepare(p, params) for p in prompts])
        texts = []
        for g in gens:  # decoded as the hf backend does: special tokens dropped, cut at the first stop string
            text = self.tok.decode([t for t in g.token_ids if t not in self._special], errors="replace")
            for stop in until:
                text = text.split(stop)[0]
            texts.append(text)
        return texts


register_model("gptlab")(GptlabLM)


# ------------------------------------------------------------------------------------------------------------
# Running tasks
# ------------------------------------------------------------------------------------------------------------
def _task_manager(tasks: Sequence[str], include_path: str | Path | None) -> Any:
    """lm-eval's task index. Indexing the ~15k built-in tasks takes ~10 s, so when every task named is found
    under include_path, only that is indexed, and the built-in index alone is built once per process. Unknown
    names are a GptlabError naming them."""
    from lm_eval.tasks import TaskManager

    for task in tasks:  # lm-eval reads any file named as a task as YAML: a .jsonl one failed in YAML's parser
        if Path(task).is_file() and Path(task).suffix not in (".yaml", ".yml"):
            raise GptlabError(f"{task}: not a task YAML file (lm-eval reads a task file as YAML; a .jsonl file of "
                              "context / choices / answer lines is a training run's eval_tasks)")
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise GptlabError(f"--include-path {include_path} is not a directory")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=str(include_path)) if include_path is not None else _builtin_tasks()
    unknown = [t for t in tasks if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        where = f" or in {include_path}" if include_path is not None else ""
        raise GptlabError(f"unknown lm-eval task(s): {', '.join(unknown)} (not among lm-eval's tasks{where}; "
                          "`lm-eval ls tasks` lists them)")
    return manager


@functools.cache
def _builtin_tasks() -> Any:
    """lm-eval's index of its built-in tasks (read-only once built, so one serves every call)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def run_tasks(
    model_path: str | Path,
    tasks: list[str],
    *,
    include_path: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str | torch.dtype | None = None,
    max_length: int | None = None,
    log_samples: bool = False,
    quantize: str | None = None,
    group_size: int | None = None,
) -> dict[str, Any]:
    """Evaluate a gptlab model (run, checkpoint or Hugging Face directory) on lm-eval tasks: lm-eval's result
    dict ("results" holds each task's metrics; "samples" each request's answers when log_samples)."""
    from lm_eval import simple_evaluate

    if not tasks:
        raise GptlabError("no tasks given: name at least one lm-eval task")
    manager = _task_manager(tasks, include_path)
    lm = GptlabLM(model_path, device=device, dtype=dtype, batch_size=batch_size, max_length=max_length,
                  quantize=quantize, group_size=group_size)
    with _fetching_task_data():
        results = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, log_samples=log_samples)
    return dict(results or {})


@contextlib.contextmanager
def _fetching_task_data() -> Iterator[None]:
    """lm-eval's tasks download their data through datasets on first use: unreachable (offline), datasets'
    ConnectionError named the dataset but not what to do instead."""
    try:
        yield
    except ConnectionError as e:
        raise GptlabError(f"{' '.join(str(e).split())}: lm-eval tasks fetch their data from the Hugging Face Hub; "
                          "offline, run them once where it is reachable (datasets keeps the data in its cache; "
                          "then set HF_DATASETS_OFFLINE=1), or use a task YAML that reads local files "
                          "(dataset_path: json) from --include-path DIR or a recipe's eval_tasks") from None


class LmEvalTasks:
    """lm-eval tasks scored on a model in memory, e.g. every N steps of a training run: the task index is built
    once (unknown names fail then), and each call returns the tasks' metrics as {"<task>/<metric>": value}."""

    def __init__(self, tasks: Sequence[str], *, limit: int | None = None, batch_size: int = 8) -> None:
        if not tasks:
            raise GptlabError("no tasks given: name at least one lm-eval task")
        self.tasks, folders = _yaml_task_names(tasks)
        if len(folders) > 1:
            raise GptlabError(f"task YAML files from {len(folders)} folders: keep a run's task files in one folder")
        self.limit, self.batch_size = limit, batch_size
        self.manager = _task_manager(self.tasks, folders.pop() if folders else None)

    def __call__(self, model: torch.nn.Module, tokenizer: TextTokenizer, name: str) -> dict[str, float]:
        from lm_eval import simple_evaluate

        lm = GptlabLM.of_model(model, tokenizer, name, batch_size=self.batch_size)
        # no global seeds set: the caller's random streams are its own (fewshot sampling has its own seed)
        with _fetching_task_data():
            results = simple_evaluate(model=lm, tasks=self.tasks, limit=self.limit, task_manager=self.manager,
                                      random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                                      log_samples=False, verbosity="WARNING")
        return flat_metrics(results or {})


def _yaml_task_names(tasks: Sequence[str]) -> tuple[list[str], set[Path]]:
    """Task names with each task YAML file among them replaced by the task it defines; the files' folders."""
    from lm_eval.tasks import TaskManager

    names, folders = [], set()
    for task in tasks:
        path = Path(task)
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            names.append(task)
            continue
        folder = path.resolve().parent
        index = TaskManager(include_path=str(folder), include_defaults=False).task_index
        found = [n for n, e in index.items() if e.yaml_path and Path(e.yaml_path).resolve() == path.resolve()]
        if not found:
            raise GptlabError(f"{path}: lm-eval finds no task in it (a task YAML names its `task:`)")
        names.append(found[0])
        folders.add(folder)
    return names, folders


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's results as {"<task>/<metric>": value}: numbers only, no standard errors; a filter other than
    "none" is kept in the name ("exact_match_strict-match")."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filtered = key.partition(",")
            if not filtered or metric.endswith("_stderr") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                out[f"{task}/{metric}" if filtered == "none" else f"{task}/{metric}_{filtered}"] = float(value)
    return out


def main() -> None:
    """`python -m gptlab.evaluation.harness ARGS`: lm-eval's own command line (`lm-eval run ARGS`), with the "gptlab"
    model registered, e.g.
    `python -m gptlab.evaluation.harness --model gptlab --model_args pretrained=RUN --tasks hellaswag`."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    # This copy of the module (__main__) registered "gptlab" above; lm-eval instantiates it from there.
    main()
