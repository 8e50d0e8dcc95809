"""``python -m cachebuild.cli``: the same as the ``cachebuild`` command."""

from cachebuild.cli.main import main

main(prog_name="cachebuild")
