"""The one exception type for input a person got wrong. Its message says what is wrong and how to
fix it; the command line prints it as one line and exits non-zero, without a traceback."""


class NanospecError(ValueError):
    pass
