"""`python -m scheduler` is the `silod` command."""

from scheduler.cli import main

main()
