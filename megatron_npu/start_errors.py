"""A start-up error that reaches the user whichever rank exits first.

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
"""

from __future__ import annotations

import json
import os
import sys
import time

ERROR_FILE_ENVVAR = "TORCHELASTIC_ERROR_FILE"
PREFIX = "megatron-npu: error: "
EXIT_STATUS = 2
#: How long a rank other than 0 waits for torchrun to stop it after rank 0 has reported.
FOLLOWER_GRACE_S = 20.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_error_file(path: str, text: str) -> None:
    # The agent reads {"message": str, "timestamp": seconds}; the earliest timestamp is the root cause.
    record = {"message": text, "timestamp": str(int(time.time()))}
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    os.replace(temporary, path)


def report_start_error(message: str, *, grace_s: float = FOLLOWER_GRACE_S) -> int:
    """Tell the user ``message`` once and return the exit status every rank exits with."""
    text = PREFIX + message
    error_file = os.environ.get(ERROR_FILE_ENVVAR)
    if not error_file:
        if _rank() == 0:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        return EXIT_STATUS
    if _rank() != 0:
        time.sleep(grace_s)  # torchrun ends this process once rank 0 has exited with the message
    _write_error_file(error_file, text)
    return EXIT_STATUS
