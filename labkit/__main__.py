"""`python -m labkit` (or `torchrun ... -m labkit`): the command line of labkit.cli, which trains
the course's model with any strategy on a laptop or a cluster. `python -m labkit --help`."""

from labkit.cli import main

raise SystemExit(main())
