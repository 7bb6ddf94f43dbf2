"""`python -m disttrace.worker --run-dir DIR`: one rank of a job (the body lives in disttrace.run.worker).
The name is a public contract: torchrun users and our own launcher start workers by it."""

import sys

from disttrace.run.worker import main

if __name__ == "__main__":
    sys.exit(main())
