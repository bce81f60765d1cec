"""Fault injection for the survival tests, loaded by Python at start-up via PYTHONPATH.

TETRAD_TEST_FAULT="KIND:RANK:STEP" makes that rank, in torchrun's first attempt only, do
KIND at the start of that training step: `raise` (an exception in a step), `kill`
(SIGKILL itself), `hang` (sleep, outside any collective), or from that step on `slow`
(sleep 50 ms per step: time to signal a run mid-way). Nothing in tetrad knows of it.
"""

import os

_fault = os.environ.get("TETRAD_TEST_FAULT")
if _fault and "RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _kind, _rank, _step = _fault.split(":")
    if int(os.environ["RANK"]) == int(_rank):
        import signal
        import time

        import tetrad.train.loop as _loop

        _original = _loop.Trainer.train_step

        def _train_step(self):
            if _kind == "slow" and self.step >= int(_step):
                time.sleep(0.05)
            if self.step == int(_step):
                if _kind == "raise":
                    raise RuntimeError(f"injected fault at step {self.step}")
                if _kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if _kind == "hang":
                    time.sleep(3600)
            return _original(self)

        _loop.Trainer.train_step = _train_step
