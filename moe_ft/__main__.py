import sys

from moe_ft.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
