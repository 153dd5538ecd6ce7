"""The fair classes inside vLLM's own server and engine on CPU: ``vllm serve`` (vLLM's OpenAI
server, ``AsyncLLM``, the engine-core process) with ``--scheduler-cls``, ``--middleware
batch.integrations.vllm.UserMiddleware`` and ``--api-key``, on a tiny Llama config and tokenizer
made here, with ``tests/vllm_fake_executor.py`` standing for the model (vLLM's CUDA wheel cannot
run one on a CPU: its CPU worker needs ``vllm._C``). vLLM's CPU platform turns async scheduling
off, so ``vllm serve`` runs ``FairScheduler`` here and refuses ``AsyncFairScheduler`` with the
class's own start-up error; vLLM's ``EngineCore`` with async scheduling on (its batch queue) runs
``AsyncFairScheduler`` in-process. Marked vllm: ``make test`` runs them in .venv-vllm."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import vllm_compare as vc  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _needs_vllm():
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")


def tiny_model(path: Path) -> Path:
    """A one-layer Llama config with a 256-word tokenizer (``w3`` .. ``w255``), no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``vllm serve`` in its own process group, stopped on exit."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port, self.log_path, self.requests_log = free_port(), tmp / "serve.log", tmp / "executor.jsonl"
        users = tmp / "users.json"
        users.write_text(json.dumps({"weights": {"alice": 2}, "api_keys": {"sk-alice": "alice", "sk-bob": "bob"}}))
        vllm_bin = Path(sys.executable).with_name("vllm")
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "BATCH_USERS_CONFIG": str(users),
               "BATCH_FAKE_EXECUTOR_LOG": str(self.requests_log),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [str(vllm_bin) if vllm_bin.exists() else shutil.which("vllm"), "serve", str(tiny_model(tmp / "model")),
             "--port", str(self.port), "--max-model-len", "512",
             "--distributed-executor-backend", "vllm_fake_executor.FakeExecutor", *args],
            cwd=tmp, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> bool:
        """True once ``/health`` answers; False if the server exited first."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return True
            except OSError:
                time.sleep(1)
        raise AssertionError(f"vllm serve not ready in {timeout_s} s:\n{self.log()[-3000:]}")

    def post(self, path: str, body: dict, key: str | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def test_vllm_serve_serves_completions_with_the_class_and_each_api_keys_user(tmp_path):
    srv = Served(tmp_path, "--scheduler-cls", "batch.integrations.vllm.FairScheduler",
                 "--middleware", "batch.integrations.vllm.UserMiddleware", "--api-key", "sk-alice", "sk-bob")
    try:
        assert srv.wait_ready(), srv.log()[-3000:]
        body = {"model": str(tmp_path / "model"), "prompt": "w5 w9 w11", "max_tokens": 5,
                "user": "mallory", "vllm_xargs": {"user": "carol"}}  # neither is believed
        for key in ("sk-alice", "sk-bob"):
            status, out = srv.post("/v1/completions", body, key)
            assert status == 200, out
            assert out["usage"] == {**out["usage"], "prompt_tokens": 3, "completion_tokens": 5}
            assert out["choices"][0]["text"].split() == ["w7"] * 5
        status, _ = srv.post("/v1/completions", body, "sk-nobody")
        assert status == 401  # vLLM's --api-key refuses a key it was not given
        seen = [json.loads(line)["user"] for line in srv.requests_log.read_text().splitlines()]
        assert seen == ["alice", "bob"]  # the middleware set each request's user from its key
        assert "Using custom scheduler class batch.integrations.vllm.FairScheduler" in srv.log()
    finally:
        srv.stop()


def test_vllm_serve_refuses_the_async_class_where_vllm_turns_async_scheduling_off(tmp_path):
    srv = Served(tmp_path, "--scheduler-cls", "batch.integrations.vllm.AsyncFairScheduler")
    try:
        assert not srv.wait_ready()  # vLLM's CPU platform sets async_scheduling = False
        assert srv.proc.returncode != 0
        assert "AsyncFairScheduler is vLLM's AsyncScheduler with Batch's fairness, but async scheduling is off" \
            in srv.log()
    finally:
        srv.stop()


def test_vllms_engine_core_runs_the_async_class_with_its_batch_queue():
    """vLLM's ``EngineCore`` (its step with a batch queue of 2: the next step scheduled before
    the last one's output), the fake executor, async scheduling on: every request completes,
    and each user is charged exactly its prompt and output tokens."""
    v = vc._vllm()
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    from vllm_fake_executor import FakeExecutor

    from batch.integrations import vllm as bv
    base = vc._vllm_config(vc.CHUNK_TOKENS)
    sc = v.SchedulerConfig(max_model_len=vc.VLLM_MAX_MODEL_LEN, is_encoder_decoder=False,
                           max_num_batched_tokens=256, long_prefill_token_threshold=64, enable_chunked_prefill=True,
                           scheduler_cls="batch.integrations.vllm.AsyncFairScheduler")
    cfg = v.VllmConfig(model_config=base.model_config, scheduler_config=sc, device_config=base.device_config,
                       cache_config=v.CacheConfig(block_size=16, enable_prefix_caching=False))
    assert cfg.scheduler_config.async_scheduling is True
    core = EngineCore(cfg, executor_class=FakeExecutor, log_stats=False)
    sched = core.scheduler
    assert type(sched) is bv.AsyncFairScheduler and core.batch_queue is not None and core.batch_queue_size == 2
    want = {}
    for i in range(12):
        user, prompt, out = ("alice" if i % 3 else "bob"), 10 + 23 * i, 3 + i
        sp = v.SamplingParams(max_tokens=out, extra_args={"user": user})
        sp.update_from_generation_config({}, eos_token_id=vc.VLLM_EOS)
        req, wave = core.preprocess_add_request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=[5] * prompt, mm_features=None, sampling_params=sp,
            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None))
        core.add_request(req, wave)
        p, o = want.get(user, (0, 0))
        want[user] = (p + prompt, o + out)
    got, delivered = {}, {}
    orig = sched.fair_policy.charge

    def charge(user, p, o):
        gp, go = got.get(user, (0, 0))
        got[user] = (gp + p, go + o)
        orig(user, p, o)
    sched.fair_policy.charge = charge
    for _ in range(2000):
        if not (sched.has_requests() or core.batch_queue):
            break
        outputs, _ = core.step_fn()
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                delivered[o.request_id] = delivered.get(o.request_id, 0) + len(o.new_token_ids)
    assert delivered == {f"r{i}": 3 + i for i in range(12)}
    assert got == want and sched._live == {} and sched._inflight == {}
