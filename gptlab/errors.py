"""The one exception type the command line turns into a one-line message and a non-zero exit."""


class GptlabError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""
