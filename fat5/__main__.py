"""`python -m fat5 COMMAND [ARGS]`: the `fat5` command (fat5/commands.py)."""

from fat5.commands import console_main

console_main()
