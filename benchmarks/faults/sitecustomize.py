"""Loaded at start-up (this directory on PYTHONPATH) by benchmarks/local_checkpoint.py's
recovery runs: TETRAD_BENCH_KILL="RANK:STEP:FILE" makes that rank, in torchrun's first
attempt only, write the time to FILE and SIGKILL itself at the start of step STEP."""

import os

_kill = os.environ.get("TETRAD_BENCH_KILL")
if _kill and "RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _rank, _step, _file = _kill.split(":", 2)
    if int(os.environ["RANK"]) == int(_rank):
        import signal
        import time

        import tetrad.train.loop as _loop

        _original = _loop.Trainer.train_step

        def _train_step(self):
            if self.step == int(_step):
                with open(_file, "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(self)

        _loop.Trainer.train_step = _train_step
