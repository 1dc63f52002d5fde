"""`python -m service [lora-serve flags]` runs the server; `python -m service client ...` the client CLI."""
import sys

from service.cli import serve_main
from service.client.cli import main as client_main

if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        sys.exit(client_main(sys.argv[2:]))
    sys.exit(serve_main(sys.argv[1:]))
