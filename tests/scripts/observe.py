"""What a process a test starts sees, and how it ends (tests/test_zygote.py compares a fork of
the test zygote with a new interpreter): ``observe`` prints its state as JSON; ``exit CODE``,
``raise``, ``interrupt`` and ``wait`` end as they say."""

import json
import os
import signal
import sys
import tempfile
import time

mode = sys.argv[1]
if mode == "observe":
    import torch

    with open("/proc/self/status") as f:
        umask = next(line.split()[1] for line in f if line.startswith("Umask:"))
    print(json.dumps(dict(
        argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0], name=__name__, umask=umask,
        probe=os.environ.get("ZYGOTE_PROBE"), tmp=tempfile.gettempdir(), threads=torch.get_num_threads(),
        signals={s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                                           signal.SIGUSR1, signal.SIGHUP, signal.SIGCHLD)},
        line_buffered=[sys.stdout.line_buffering, sys.stderr.line_buffering],
        write_through=[sys.stdout.write_through, sys.stderr.write_through],
        own_session=os.getsid(0) == os.getpid(), stdin=sys.stdin.read())))
elif mode == "exit":
    sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
elif mode == "raise":
    raise ValueError("boom")
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "wait":
    print("waiting", flush=True)
    time.sleep(120)
