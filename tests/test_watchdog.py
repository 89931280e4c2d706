"""The stall watchdog measures progress, not duration: a long section that reports progress is not a stall, one
that does not is; time a process spent stopped is nobody's stall; a stopped process is named as not answering;
an unanswered request to the vLLM server is a stall too; and its timeouts come in a stated order."""

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from rloo.timing import StepTimer
from rloo.watchdog import StallWatchdog, TrainingStalled, collect_stacks, report_path


def test_a_slow_section_that_reports_progress_is_not_a_stall_and_one_that_does_not_is(tmp_path):
    timer = StepTimer()
    watchdog = StallWatchdog(
        timer, SimpleNamespace(stall_timeout_s=1.5, output_dir=str(tmp_path)), rank=0
    )
    watchdog.on_train_begin(None, None, None)
    try:
        timer.begin_step()
        with timer.section("rewards"):  # 3 s in one section, progress every 0.25 s
            for _ in range(12):
                time.sleep(0.25)
                timer.advance()
        assert not watchdog.message and not os.path.exists(report_path(str(tmp_path), 0))
        with pytest.raises(
            TrainingStalled, match=r"no progress for 1.5 s .* waiting in train > rewards"
        ):
            with timer.section("train"), timer.section("rewards"):
                time.sleep(30)  # (interrupted by the watchdog)
    finally:
        watchdog.close()
    assert "test_watchdog.py" in open(report_path(str(tmp_path), 0)).read()  # this process's stack


def test_a_stopped_process_is_named_as_not_answering(tmp_path):
    from rloo.watchdog import _started

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        import socket

        with open(tmp_path / "rank1.pid", "w") as handle:
            handle.write(f"{socket.gethostname()} {sleeper.pid} {_started(sleeper.pid)}")
        stacks = collect_stacks(str(tmp_path), wait_s=0.5)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (
        stacks
        == f"--- rank1 (pid {sleeper.pid}): no answer within 0.5 s: stopped (SIGSTOP) or stuck outside "
        "Python"
    )


SUSPENDED = """
import os, time
from datasets import Dataset
from rloo import RLOOConfig, RLOOTrainer
from rloo.tiny import tiny_causal_lm, tiny_tokenizer

def reward(completion_ids, trainer_state, **kwargs):
    if trainer_state.global_step == 1:
        open(MARK, "w").close()  # the test stops this process now, in the middle of step 2
        time.sleep(1.0)
    return [1.0] * len(completion_ids)

tokenizer = tiny_tokenizer()
data = Dataset.from_list([{"prompt": [{"role": "user", "content": w}]} for w in ["a b", "c d"] * 8])
args = RLOOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=2, num_generations=2,
                  max_completion_length=4, max_steps=3, report_to="none", save_strategy="no", disable_tqdm=True,
                  stall_timeout_s=3)
RLOOTrainer(model=tiny_causal_lm(tokenizer), reward_funcs=reward, args=args, train_dataset=data,
            processing_class=tokenizer).train()
print("FINISHED")
"""


def test_a_trainer_suspended_longer_than_the_stall_timeout_trains_on_when_continued(tmp_path):
    """SIGSTOP in the middle of a step for 8 s, more than twice stall_timeout_s (what SLURM's suspend or gang
    scheduling does to a job), then SIGCONT: the run finishes, no stall reported."""
    script, out, mark = tmp_path / "suspended.py", tmp_path / "out", tmp_path / "in-step-2"
    script.write_text(f"OUT, MARK = {str(out)!r}, {str(mark)!r}\n" + SUSPENDED)
    job = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), job.communicate()[0][-3000:]
        os.kill(job.pid, signal.SIGSTOP)
        time.sleep(8)
        os.kill(job.pid, signal.SIGCONT)
        output = job.communicate(timeout=120)[0]
    finally:
        job.kill()
    assert job.returncode == 0 and "FINISHED" in output, output[-3000:]
    assert not [name for name in os.listdir(out) if name.startswith("stall-report")]


def test_a_request_the_server_never_answers_is_a_resumable_stall():
    """The vLLM client's read timeout (vllm_request_timeout_s): a stall, which the CLI ends with the watchdog's
    resumable exit code, naming the route and the setting."""
    from rloo.generation.vllm_client import ServerStalled, VLLMServerClient

    class Silent(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            time.sleep(5)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = VLLMServerClient(f"http://127.0.0.1:{server.server_port}", request_timeout_s=0.5)
        with pytest.raises(
            ServerStalled,
            match=r"POST http://127.0.0.1:\d+/v1/completions got no answer for "
            r"0.5 s \(vllm_request_timeout_s\)",
        ) as caught:
            client._call("POST", "/v1/completions", {})
        assert isinstance(caught.value, TrainingStalled)
    finally:
        server.shutdown()


def test_the_timeouts_come_in_order_the_watchdog_first(tmp_path):
    from rloo import RLOOConfig
    from rloo.generation.vllm_server import request_timeout

    def config(**kwargs):
        return RLOOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs
        )

    default = config()
    assert default.ddp_timeout == 2400 and request_timeout(default) == 1860.0
    assert request_timeout(config(stall_timeout_s=None)) == 1800.0
    assert request_timeout(config(vllm_request_timeout_s=90)) == 90
    with pytest.raises(
        ValueError,
        match=r"ddp_timeout=1800 must exceed stall_timeout_s=1800 by 60 s or more.*"
        r"Fix: ddp_timeout >= 1860",
    ):
        config(ddp_timeout=1800)
    assert config(ddp_timeout=1800, stall_timeout_s=600).ddp_timeout == 1800

    from infra.runconfig import load_run_config

    tiny = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "tiny.yaml")
    slurm = ["launch.executor=slurm", "training.per_device_train_batch_size=2"]
    assert load_run_config(tiny, slurm).collective_timeout_s() == 2100  # stall_timeout_s 1800 + 300
    with pytest.raises(
        Exception,
        match=r"launch.slurm.collective_timeout_s=600 must exceed "
        r"training.stall_timeout_s=1800",
    ):
        load_run_config(tiny, [*slurm, "launch.slurm.collective_timeout_s=600"])
