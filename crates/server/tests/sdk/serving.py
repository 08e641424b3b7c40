"""What the SDK scripts share: the fixtures, a real `oxlm serve` (the binary is the script's first
argument) on a free port, and named checks counted to a closing 'N passed, N failed' line. The
scripts run as `python3 crates/server/tests/sdk/X.py OXLM_BINARY`, so this folder is on their path."""
import os, socket, subprocess, sys, time, urllib.request

FIXTURES = os.path.dirname(os.path.abspath(__file__)) + "/../../../../tests/fixtures"
# The tiny model the scripts serve; its golden.json has the oracle's prompt and greedy reply.
TINY_MODEL = f"{FIXTURES}/tiny/llama-8bit-g32"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model, *flags, ready="/health", attempts=300):
    """An `oxlm serve` of `model` on a free port, once `ready` answers 200 (or after `attempts`
    tries, a tenth of a second apart), and its base URL."""
    port = free_port()
    process = subprocess.Popen([sys.argv[1], "serve", "--model", model, "--port", str(port), *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(attempts):
        try:
            urllib.request.urlopen(f"{base}{ready}", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return process, base


class Checks:
    """Named checks against `servers`, each reported as it ends; a failed one does not stop the
    others. Leaving the `with` block stops the servers, which must shut down gracefully; then,
    unless an exception is on its way out, it prints 'N passed, N failed' and exits, 1 on any
    failure."""

    def __init__(self, *servers):
        self.servers = servers
        self.passed, self.failed = 0, 0

    def __enter__(self):
        return self

    def run(self, checks):
        """Runs each (name, function) of `checks`."""
        for name, fn in checks:
            try:
                fn()
                self.passed += 1
                print(f"ok   {name}")
            except Exception as e:  # a failed check is reported, the others still run
                self.failed += 1
                print(f"FAIL {name}: {e!r}")

    def __exit__(self, error_type, error, traceback):
        for process in self.servers:
            process.terminate()
            # SIGTERM is a graceful shutdown: exit status 0.
            if process.wait(timeout=10) != 0:
                self.failed += 1
                print(f"FAIL exit status {process.returncode} after SIGTERM")
        if error_type is None:
            print(f"{self.passed} passed, {self.failed} failed")
            sys.exit(1 if self.failed else 0)
