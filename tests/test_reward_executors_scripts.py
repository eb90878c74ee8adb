"""executor="process" with reward functions where TRL users write them: at the top of a
script without an ``if __name__ == "__main__":`` guard, or in code piped to ``python -``
(as a notebook cell: a ``__main__`` with no file). Real interpreters run real code; the
script's top level must run once (workers never import ``__main__``), and the rewards
must be right."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

# a module next to the script: its function goes to the workers by reference (they get
# the script's sys.path: its folder, or '' for python -)
MODULE = """
def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
"""

# top level, no guard: a reward function reading a global of the script, a wrapper over it
SCRIPT = """
import os
from tensordict import TensorDict
from torchrl_trl.rewards import RewardExecutor, RewardFunctionWrapper
from next_to_the_script import length

with open(os.environ["TOP_LEVEL_LOG"], "a") as log:
    log.write("top level ran\\n")

BONUS = 100.0

def length_plus_bonus(prompts, completions, **kwargs):
    return [BONUS + len(c if isinstance(c, str) else c[-1]["content"]) for c in completions]

wrapper = RewardFunctionWrapper([length_plus_bonus, length], weights=[1.0, 1000.0],
                                executor=RewardExecutor("process", max_workers=2, timeout=60))
texts = ["a", "bb", "cccc"]
td = TensorDict({"text": {"prompt": ["q"] * 3, "response": texts}}, batch_size=[3])
print("REWARDS", wrapper(td)["next", "reward"].reshape(-1).tolist(), flush=True)
print("FAILURES", wrapper.failure_counts, flush=True)
wrapper.shutdown()
"""


def _run(tmp_path, code: str, *, from_stdin: bool) -> tuple[str, int]:
    """Run ``code`` as a script file (from another folder) or piped to ``python -`` (in
    the script's folder); its stdout and how many times its top level ran."""
    (tmp_path / "next_to_the_script.py").write_text(MODULE)
    (tmp_path / "elsewhere").mkdir()
    log = tmp_path / "top_level.log"
    env = {**os.environ, "TOP_LEVEL_LOG": str(log), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if from_stdin:
        cmd, stdin = [sys.executable, "-"], code
    else:
        (tmp_path / "train.py").write_text(code)
        cmd, stdin = [sys.executable, str(tmp_path / "train.py")], None
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=240, env=env,
                          cwd=str(tmp_path if from_stdin else tmp_path / "elsewhere"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout, len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("from_stdin", [False, True], ids=["unguarded_script", "stdin"])
def test_reward_function_of_main_in_process_workers(tmp_path, from_stdin):
    out, top_level_runs = _run(tmp_path, SCRIPT, from_stdin=from_stdin)
    assert "REWARDS [1101.0, 2102.0, 4104.0]" in out, out
    none = {"error": 0, "timeout": 0, "crash": 0}
    assert f"FAILURES {({'length_plus_bonus': none, 'length': none})}" in out, out
    assert top_level_runs == 1


# the same inside GRPOTrainer.train(): a TRL reward function of an unguarded script
TRAIN_SCRIPT = """
import os
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from torchrl_trl.rewards import RewardExecutor, as_trl_reward_func

with open(os.environ["TOP_LEVEL_LOG"], "a") as log:
    log.write("top level ran\\n")

def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

reward = as_trl_reward_func(length_reward, executor=RewardExecutor("process", max_workers=1, timeout=60))
seen = []

def recorded(prompts, completions, **kwargs):
    out = reward(prompts, completions, **kwargs)
    seen.append(out == [float(len(c)) for c in completions])
    return out

recorded.__name__ = "length_reward"
args = GRPOConfig(
    output_dir=os.environ["OUTPUT_DIR"], max_steps=2, per_device_train_batch_size=4, num_generations=2,
    max_completion_length=8, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
    logging_steps=1, shuffle_dataset=False,
)
trainer = GRPOTrainer(
    model=os.environ["POLICY"], reward_funcs=[recorded], args=args,
    train_dataset=Dataset.from_dict({"prompt": [f"question {i}" for i in range(4)]}),
)
trainer.train()
reward.shutdown()
print("STEPS", trainer.state.global_step, "CALLS", seen, "SCORED", reward.scored, flush=True)
print("FAILURES", reward.failure_counts, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_trainer_train_with_a_reward_function_of_an_unguarded_script(tmp_path, checkpoints, monkeypatch):
    monkeypatch.setenv("POLICY", str(checkpoints.policy))
    monkeypatch.setenv("OUTPUT_DIR", str(tmp_path / "out"))
    out, top_level_runs = _run(tmp_path, TRAIN_SCRIPT, from_stdin=False)
    assert "STEPS 2 CALLS [True, True] SCORED 8" in out, out
    assert "FAILURES {'error': 0, 'timeout': 0, 'crash': 0}" in out, out
    assert top_level_runs == 1


# a trainer whose pool is started from a helper thread (so the kernel's parent-death signal
# is not set) and whose worker runs a task that never returns
ORPHAN_SCRIPT = """
import os
import threading
import time
from tensordict import TensorDict
from torchrl_trl.rewards import RewardExecutor, RewardFunctionWrapper

def stuck(prompts, completions, **kwargs):
    open(os.environ["STARTED"], "w").close()
    while True:
        pass

wrapper = RewardFunctionWrapper(stuck, executor=RewardExecutor("process", max_workers=1))
td = TensorDict({"text": {"prompt": ["q"], "response": ["a"]}}, batch_size=[1])
threading.Thread(target=wrapper, args=(td,), daemon=True).start()
while not os.path.exists(os.environ["STARTED"]):  # the worker runs the task
    time.sleep(0.05)
print("WORKERS", *wrapper.executor.worker_pids, flush=True)
threading.Event().wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_exits_when_its_trainer_is_killed(tmp_path):
    """The trainer-death watch: a worker running a task that never returns exits once the
    trainer that started it is SIGKILLed (nothing is left burning a CPU)."""
    import signal
    import time

    (tmp_path / "train.py").write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "STARTED": str(tmp_path / "started")}
    trainer = subprocess.Popen([sys.executable, str(tmp_path / "train.py")], stdout=subprocess.PIPE,
                               text=True, env=env)
    try:
        line = trainer.stdout.readline()
        assert line.startswith("WORKERS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert pids and all(_alive(p) for p in pids)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    for _ in range(600):  # bounded against a hang; the watch reacts at once
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids
