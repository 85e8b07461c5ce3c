import sys

from moe_ft.agent.server import main

if __name__ == "__main__":
    sys.exit(main())
