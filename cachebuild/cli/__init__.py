"""The ``cachebuild`` command line: ``main`` (the group and its table of commands), and
the command modules ``store``, ``model`` and ``remote``, which share ``common``."""
