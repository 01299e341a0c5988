"""``python -m lenext.report``: the ``lenext-report`` command."""

from lenext.report.command import main

main()
