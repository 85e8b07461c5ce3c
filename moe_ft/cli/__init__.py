"""The ``moe-ft`` command line. Each module in this package that defines ``register(subparsers)``
contributes one subcommand (see ``main.py``)."""
