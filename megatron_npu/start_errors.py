"""A start-up error that reaches the user whichever rank exits first; a failure during a run
that names the rank where it began.

Every rank validates the same configuration and fails the same way. Under torchrun the
first rank to exit makes the agent terminate the others, so a message printed by rank 0
alone is lost whenever another rank wins that race. torchrun's own channel for a
rank's error is the file named by ``TORCHELASTIC_ERROR_FILE`` (what
``torch.distributed.elastic.multiprocessing.errors.record`` writes): the agent prints
the earliest one as the job's root cause. Rank 0 writes it and exits at once; the other
ranks write theirs only if torchrun has not stopped them within a grace period, so the
message appears once, and still appears when rank 0 never gets that far. Without torchrun
(a plain process) the message goes to stderr from rank 0.

torch's ``ErrorHandler`` records an exception with its traceback; a configuration error
is one line for the user, so the file is written here in the agent's plain-message form.

During a run, one rank fails first (a non-finite loss, a bug, a killed process) and the
others fail after it, in the collective they were waiting on with the failed rank ("Connection
closed by peer"). The agent names the earliest failure as the root cause; a follower that
exits at once can beat the failed rank to it. So a rank that does not know it is the origin
(an exception it did not anticipate) waits ``RUN_FAILURE_GRACE_S`` for torchrun to stop it
first, then records its exception; on one node torchrun stops the followers within its
0.1 s monitor interval, and across nodes the rank reports after the grace (a hung peer: after
the collective timeout, ``--distributed-timeout-minutes``). A rank that has reported a run
failure leaves at once (``exit_now``): its collectives are broken, a normal interpreter exit
tears down the process groups and can block on their pending work (seen on the cpu target
under load: a reported rank still alive after its follower's 3 s grace had run out), and its
exit is what torchrun waits for to stop the others.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import NoReturn

ERROR_FILE_ENVVAR = "TORCHELASTIC_ERROR_FILE"
PREFIX = "megatron-npu: error: "
EXIT_STATUS = 2
RUN_EXIT_STATUS = 1
#: How long a rank other than 0 waits for torchrun to stop it after rank 0 has reported.
FOLLOWER_GRACE_S = 20.0
#: How long a rank whose run failed waits for torchrun to stop it on behalf of a rank that failed first.
RUN_FAILURE_GRACE_S = 5.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_error_file(path: str, record: dict) -> None:
    """Replace torchrun's error file with ``record`` at once (the agent may read it any time)."""
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    os.replace(temporary, path)


def _message_record(text: str) -> dict:
    # The agent reads {"message": str, "timestamp": seconds}; the earliest timestamp is the root cause.
    return {"message": text, "timestamp": str(int(time.time()))}


def _stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def report_start_error(message: str, *, grace_s: float = FOLLOWER_GRACE_S) -> int:
    """Tell the user ``message`` once and return the exit status every rank exits with."""
    text = PREFIX + message
    error_file = os.environ.get(ERROR_FILE_ENVVAR)
    if not error_file:
        if _rank() == 0:
            _stderr(text)
        return EXIT_STATUS
    if _rank() != 0:
        time.sleep(grace_s)  # torchrun ends this process once rank 0 has exited with the message
    _write_error_file(error_file, _message_record(text))
    return EXIT_STATUS


def exit_now(status: int) -> NoReturn:
    """End this process without tearing down its process groups (see the module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def report_run_error(message: str) -> int:
    """A fault this rank found itself (it is the origin): tell the user now, return the exit status."""
    text = PREFIX + message
    error_file = os.environ.get(ERROR_FILE_ENVVAR)
    if error_file:
        _write_error_file(error_file, _message_record(text))
    else:
        _stderr(text)
    return RUN_EXIT_STATUS


def report_run_failure(error: BaseException, where: str, *, grace_s: float = RUN_FAILURE_GRACE_S) -> int:
    """An unexpected exception during a run (call from its ``except`` block): its traceback,
    prefixed by ``where`` (the rank and iteration), for torchrun's summary, unless torchrun stops
    this rank first on behalf of a rank that failed earlier. Returns the exit status."""
    error_file = os.environ.get(ERROR_FILE_ENVVAR)
    header = f"{PREFIX}{where}: {type(error).__name__}: {error}"
    if not error_file:
        _stderr(traceback.format_exc() + header)
        return RUN_EXIT_STATUS
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # --exit-signal-handler must not keep torchrun from stopping us
    time.sleep(grace_s)
    # torch's ErrorHandler.record_exception format: the agent prints py_callstack as the traceback
    record = {
        "message": {
            "message": header,
            "extraInfo": {"py_callstack": f"{header}\n{traceback.format_exc()}", "timestamp": str(int(time.time()))},
        }
    }
    _write_error_file(error_file, record)
    return RUN_EXIT_STATUS
