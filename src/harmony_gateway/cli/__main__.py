"""`python -m harmony_gateway.cli`: the same as the `harmony-gateway` command."""

from . import main

main()
