"""Evaluation: how well a model predicts text, three ways.

    loss     loss, perplexity and bits per byte over a whole split of a prepared data directory (`gptlab eval RUN
             --data DIR`, and the trainer's validation loss), split across a run's processes
    tasks    multiple-choice .jsonl tasks scored by log-likelihood, offline (a training run's eval_tasks), and the
             scoring routine the harness shares
    harness  the lm-eval-harness adapter: gptlab models as lm-eval's "gptlab" model (`gptlab eval RUN --tasks ...`,
             `python -m gptlab.evaluation.harness ...`)

They sit at different heights of the pipeline (training and generation use `loss` and `tasks`; `harness` uses
generation), so this package imports none of them: import the module you need.
"""
