"""`python -m disttrace.worker --run-dir DIR`: one rank of a job (the body lives in disttrace.run.job.worker).
The name is a public contract: torchrun users and our own launcher start workers by it."""

import os
import sys

from disttrace.run.job.worker import main

if __name__ == "__main__":
    code = main()
    # A rank that finished skips the interpreter's teardown: everything is written, flushed and closed and
    # the process group destroyed by now, but gloo's threads (and a C signal handler the Flight Recorder
    # copy installs) can abort a finalizing interpreter ("terminate called without an active exception",
    # seen here at the end of complete runs), which would turn a complete run into a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
