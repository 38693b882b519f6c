"""torchrun (``torch.distributed.run``) as ``mimose train --nproc-per-node`` runs it: the same,
except that it ends without torchrun's traceback when a signal stopped it or a rank failed; the
ranks have said what happened (rank 0's status is passed on, ``spawn.relaunch``), and a rank that
ended without saying it is named in one line; its agent's log lines about a failed rank are left
out (``mimose --debug`` keeps them). It gets SIGTERM when ``mimose train`` dies
(``spawn.py``)."""

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

from mimose_cli.launcher.signals import stop_with_parent
from mimose_cli.launcher.spawn import AGENT_PID_ENV, EXIT_FILE_ENV, LAUNCHER_PID_ENV

if __name__ == "__main__":
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is not None:  # SIGTERM when mimose's launcher dies, forwarded to the ranks as any
        stop_with_parent(int(launcher))
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks inherit it: they watch this process
    if "--debug" not in sys.argv:  # the ranks say what failed; torchrun's agent adds a warning and an
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # error line per failure
    try:
        main()
    except SignalException as error:  # forwarded to the ranks, which stopped after their step
        sys.exit(128 + int(error.sigval))
    except ChildFailedError as error:
        if not os.path.exists(os.environ.get(EXIT_FILE_ENV, "")):  # rank 0 did not get to say why
            rank, failure = error.get_first_failure()
            print(f"error: rank {rank} of torchrun's processes exited with status {failure.exitcode}",
                  file=sys.stderr)
        sys.exit(1)
