"""Peer benchmark: MaxText (Google's JAX LLM trainer, PyPI ``maxtext`` 0.2.5) trains the shape of the GPU suite's
``llama3_8b 8/32 layers bf16`` case on the same machine, with MaxText's own trainer and its GPU settings.

    python3 benchmarks/peer_maxtext.py --result peer.json            # on the GPU machine, from the source tree
    python3 benchmarks/peer_maxtext.py --result peer.json --smoke    # the same code path on a CPU, tiny shape

The shape: Llama-3 8B's dimensions (MaxText's ``llama3-8b`` model config: embed 4096, 32 heads, 8 KV heads, head
dim 128, MLP 14336, vocabulary 128256, RoPE theta 500000, RMSNorm eps 1e-5, untied head) with 8 of its 32 layers,
sequence 4096, per-device (= global) batch 4, bf16 compute (MaxText's ``dtype``; its weights and Adam stay fp32),
synthetic data, no checkpoints. The run starts from MaxText's GPU recipe for this model,
``maxtext/configs/gpu/models/llama3_8b.yml`` (remat ``minimal_with_context``, iota embedding, a reused synthetic
batch), changes its attention from ``cudnn_flash_te`` (Transformer Engine, not on the machines) to MaxText's
``cudnn_flash_jax`` (the same cuDNN fused kernel through JAX's own API; with ``packing=False shardy=False`` as
MaxText's own GPU test of that kernel sets them), and tiles the loss over the vocabulary in 8 chunks
(``num_vocab_tiling=8``, as jaxtron's case does with ``train.logit_chunks=8``). XLA_FLAGS are MaxText's for one A3
(8 x H100) VM, ``maxtext/configs/gpu/a3/llama_2_7b/1vm.sh``, less its HLO dump.

Steps (the parent never imports jax):

1. the wheels of ``--wheels`` (default ``.whl/peer`` from ``scripts/peer_wheels.sh``, then jaxtron's ``.whl``) are
   installed with ``pip install --no-index --no-deps --target`` into a folder put on the trainer's PYTHONPATH;
2. modules MaxText imports at load time but never uses on this path, and which the machine lacks (transformers,
   huggingface_hub, tokenizers, sympy, tiktoken, sentencepiece), get stand-ins that raise when called (``STUBS``);
3. ``python -m maxtext.trainers.pre_train.train <llama3_8b.yml> key=value ...`` runs ``--steps`` steps (12) with
   ``DECOUPLE_GCLOUD=TRUE`` (MaxText's own switch for running without Google Cloud) and writes its per-step
   metrics file; if it fails, an out-of-memory error retries with remat ``full`` and another error with
   ``attention=dot_product`` (``--no-fallback`` turns this off), within ``--budget`` seconds;
4. the result: MaxText's step time ("seconds" of each step: the wall time between two steps' dispatches, the
   device time once steps queue) as the median over the steps after the first two, tokens/s = global batch x
   sequence / that median, and MaxText's own TFLOP/s/device, loss and memory estimate, into ``--result``.

Exit code 0 when the run trained and was measured, 1 when it did not (``error`` in the JSON says why in one line),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = "maxtext.trainers.pre_train.train"
# resolved by MaxText against its installed configs folder (maxtext/configs/pyconfig.py resolve_config_path)
CONFIG = "src/maxtext/configs/gpu/models/llama3_8b.yml"
SKIP_STEPS = 2  # the first two steps hold compilation and the first dispatches
# MaxText's XLA flags for one A3 VM (8 x H100): maxtext/configs/gpu/a3/llama_2_7b/1vm.sh, less --xla_dump_to; the
# collective ones change nothing on one GPU. jaxlib 0.11.2 accepts each of them.
MAXTEXT_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
    "--xla_gpu_enable_command_buffer= --xla_gpu_enable_highest_priority_async_stream=true "
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728 --xla_gpu_all_gather_combine_threshold_bytes=134217728 "
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 --xla_gpu_pipeline_all_gather=on "
    "--xla_gpu_pipeline_reduce_scatter=on --xla_gpu_pipeline_all_reduce=on "
    "--xla_gpu_enable_while_loop_double_buffering=true "
    "--xla_gpu_enable_all_gather_combine_by_dim=false --xla_gpu_enable_reduce_scatter_combine_by_dim=false "
    "--xla_disable_hlo_passes=rematerialization")
ENV = {
    "DECOUPLE_GCLOUD": "TRUE",  # MaxText's gcloud_stub: no GCS, Vertex, goodput or JetStream clients
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92",  # as jaxtron's GPU preset (jax's default preallocation is 75%)
    "PYTHONUNBUFFERED": "1",
}
SHAPE = {"base_num_decoder_layers": 8, "max_target_length": 4096, "per_device_batch_size": 4}
SMOKE_SHAPE = {"base_emb_dim": 256, "base_num_query_heads": 4, "base_num_kv_heads": 2, "head_dim": 64,
               "base_mlp_dim": 512, "vocab_size": 1024, "base_num_decoder_layers": 2, "max_target_length": 128,
               "per_device_batch_size": 2}
# config values read back from MaxText's printed config, to show what it trained
REPORTED = ("model_name", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim", "base_mlp_dim",
            "vocab_size", "base_num_decoder_layers", "num_decoder_layers", "max_target_length",
            "per_device_batch_size", "global_batch_size_to_train_on", "rope_max_timescale",
            "normalization_layer_epsilon", "logits_via_embedding", "dtype", "weight_dtype", "attention",
            "remat_policy", "scan_layers", "num_vocab_tiling", "dataset_type", "reuse_example_batch", "use_iota_embed",
            "packing", "opt_type", "hardware", "shardy")

# Stand-ins for modules MaxText 0.2.5's train path imports at module level but does not use with synthetic data
# and no checkpoints: top-level name -> (submodules imported by name, who imports it)
STUBS = {
    "transformers": (("configuration_utils",), ("checkpoint_conversion/utils/hf_model_configs.py (builds Hugging "
                                                "Face config objects at import), input_pipeline/tokenizer.py")),
    "huggingface_hub": ((), "checkpoint_conversion/utils/load_dynamic.py, utils/model_creation_utils.py"),
    "tokenizers": ((), "layers/engram.py (DeepSeek's Engram layer)"),
    "sympy": ((), "layers/engram.py"),
    "tiktoken": (("load",), "input_pipeline/tokenizer.py (real data only)"),
    "sentencepiece": ((), "input_pipeline/tokenizer.py (real data only)"),
}
_STUB_BODY = '''\
"""Stand-in for {name}, written by jaxtron's benchmarks/peer_maxtext.py: MaxText 0.2.5 imports it at module level
({why}) but does not use it to train on synthetic data without checkpoints. Calling anything from it raises."""
__version__ = "0+stub"


class _Missing:
    def __init__(self, path):
        self._path = path

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(self._path + "." + attr)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(self._path + " was called, but {top} is a stub in jaxtron's peer benchmark")

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
{extra}    return _Missing(__name__ + "." + attr)
'''
_TRANSFORMERS_CONFIGS = '''\
    if attr.endswith("Config"):  # hf_model_configs builds Hugging Face config objects at import time
        from transformers.configuration_utils import PretrainedConfig
        return type(attr, (PretrainedConfig,), {})
'''
_CONFIG_CLASS = '''

class PretrainedConfig:
    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)


PreTrainedConfig = PretrainedConfig
'''
# __version__ "0+stub" sorts below "5.0.0", so hf_model_configs takes configuration_utils.PretrainedConfig


def write_stubs(root: str, names: list[str]) -> None:
    for name in names:
        subs, why = STUBS[name]
        os.makedirs(os.path.join(root, name), exist_ok=True)
        extra = _TRANSFORMERS_CONFIGS if name == "transformers" else ""
        with open(os.path.join(root, name, "__init__.py"), "w", encoding="utf-8") as f:
            f.write(_STUB_BODY.format(name=name, top=name, why=why, extra=extra))
        for sub in subs:
            body = _STUB_BODY.format(name=f"{name}.{sub}", top=name, why=why, extra="")
            if (name, sub) == ("transformers", "configuration_utils"):
                body += _CONFIG_CLASS
            with open(os.path.join(root, name, sub + ".py"), "w", encoding="utf-8") as f:
                f.write(body)


def _dist_name(wheel: str) -> str:
    return re.sub(r"[-_.]+", "_", os.path.basename(wheel).split("-")[0]).lower()


def install_wheels(dirs: list[str], target: str, python: str, log) -> dict:
    """pip-install the wheels of ``dirs`` (the first folder's wins for a name found in two) into ``target``."""
    chosen: dict[str, str] = {}
    for d in dirs:
        for w in sorted(glob.glob(os.path.join(d, "*.whl"))):
            chosen.setdefault(_dist_name(w), w)
    if not chosen:
        return {"status": "none found", "dirs": dirs}
    shutil.rmtree(target, ignore_errors=True)
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--ignore-requires-python", "--disable-pip-version-check", "--target", target, *chosen.values()]
    log.write(f"===== wheels: {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=False).returncode
    names = sorted(os.path.basename(w) for w in chosen.values())
    if rc != 0:
        return {"status": f"pip failed (exit {rc})", "dirs": dirs, "wheels": names}
    return {"status": "installed", "dirs": dirs, "target": target, "wheels": names}


def missing_modules(python: str, env: dict, names) -> list[str]:
    """Which of ``names`` the trainer's interpreter cannot find (find_spec imports no package)."""
    code = ("import importlib.util, json, sys; "
            "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))")
    out = subprocess.run([python, "-c", code, *names], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def maxtext_version(paths: list[str]) -> str | None:
    import importlib.metadata
    for dist in importlib.metadata.distributions(path=[p for p in paths if p]):
        if (dist.metadata["Name"] or "").lower() == "maxtext":
            return dist.version
    return None


def overrides(args, run_dir: str, attention: str, remat: str) -> list[str]:
    o = {"run_name": "peer_maxtext", "base_output_directory": os.path.join(run_dir, "out"),
         "override_model_config": True,  # lets the command line change the llama3-8b model's layers
         "hardware": "cpu" if args.smoke else "gpu", "skip_jax_distributed_system": True,
         **(SMOKE_SHAPE if args.smoke else SHAPE),
         "steps": args.steps, "dataset_type": "synthetic", "enable_checkpointing": False,
         "enable_goodput_recording": False, "enable_tensorboard": False,
         "attention": attention, "remat_policy": remat, "num_vocab_tiling": args.vocab_tiling,
         "metrics_file": os.path.join(run_dir, "metrics.jsonl")}
    if attention == "cudnn_flash_jax":
        # as MaxText's own GPU test of this kernel (tests/integration/train_tests.py test_gpu_cudnn_flash_jax):
        # "The cudnn kernel is not compatible with shardy"
        o.update(packing=False, shardy=False)
    for kv in args.override:
        k, _, v = kv.partition("=")
        o[k] = v
    return [CONFIG] + [f"{k}={v}" for k, v in o.items()]


STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), "
                       r"Tokens/s/device: ([\d.]+).*?\bloss: ([\d.]+)")
ERROR_LINE = re.compile(r"(RESOURCE_EXHAUSTED|[Oo]ut of memory|\b\w*(Error|Exception)\b:)")


def parse_steps(run_dir: str, log_text: str) -> list[dict]:
    """The per-step metrics: MaxText's metrics file, else its 'completed step' log lines."""
    steps: dict[int, dict] = {}
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    m = json.loads(line)
                    steps[int(m["step"])] = {
                        "step": int(m["step"]), "seconds": m.get("perf/step_time_seconds"),
                        "tflops_per_s_device": m.get("perf/per_device_tflops_per_sec"),
                        "tokens_per_s_device": m.get("perf/per_device_tokens_per_sec"),
                        "loss": m.get("learning/loss")}
    except (OSError, ValueError, KeyError):
        steps = {}
    if not steps:
        for m in STEP_LINE.finditer(log_text):
            steps[int(m[1])] = {"step": int(m[1]), "seconds": float(m[2]), "tflops_per_s_device": float(m[3]),
                                "tokens_per_s_device": float(m[4]), "loss": float(m[5])}
    return [steps[k] for k in sorted(steps)]


def error_line(text: str, rc: int | None, timed_out: bool, limit: float) -> str:
    if timed_out:
        return f"MaxText's trainer ran past its {limit:.0f} s time box"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [i for i, ln in enumerate(lines) if ERROR_LINE.search(ln)]
    if not hits:
        return f"exit {rc}: {(lines or ['no output'])[-1][:400]}"
    i = hits[-1]
    line = " ".join(lines[i:i + 3]) if "ValidationError" in lines[i] else lines[i]  # pydantic: the field, why
    return f"exit {rc}: {line[:400]}"


def run_attempt(args, python: str, env: dict, attention: str, remat: str, limit: float, log) -> dict:
    run_dir = tempfile.mkdtemp(prefix="peer_maxtext_")
    argv = [python, "-m", ENTRY, *overrides(args, run_dir, attention, remat)]
    log.write(f"\n===== attempt: attention={attention} remat_policy={remat}, {limit:.0f} s\n"
              f"cd {run_dir} && {' '.join(argv)}\n")
    log.flush()
    start = time.monotonic()
    out_path = os.path.join(run_dir, "train.log")
    timed_out = False
    with open(out_path, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(argv, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)
            rc = proc.wait()
    with open(out_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    log.write(text)
    log.flush()
    steps = parse_steps(run_dir, text)
    attempt = {"attention": attention, "remat_policy": remat, "rc": rc, "seconds": round(time.monotonic() - start, 1),
               "argv": argv[1:], "run_dir": run_dir, "steps": steps, "text": text}
    if rc != 0 or timed_out or len(steps) <= SKIP_STEPS:
        attempt["error"] = (error_line(text, rc, timed_out, limit) if rc != 0 or timed_out
                            else f"MaxText reported {len(steps)} steps, not more than the {SKIP_STEPS} skipped")
    return attempt


def summarize(args, attempt: dict) -> dict:
    text = attempt["text"]
    steps = attempt["steps"]
    timed = [s["seconds"] for s in steps if s["step"] >= SKIP_STEPS and s["seconds"]]
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    tokens = shape["per_device_batch_size"] * shape["max_target_length"]  # one device: global batch = per device
    median = statistics.median(timed)
    config = {}
    for key in REPORTED:
        m = re.findall(rf"Config param {re.escape(key)}: (.*)", text)
        if m:
            config[key] = m[-1].strip()

    def last(pattern: str, number: bool = True):
        found = re.findall(pattern, text)
        return (float(found[-1]) if number else found[-1]) if found else None

    tflops_dev = [s["tflops_per_s_device"] for s in steps if s["step"] >= SKIP_STEPS and s["tflops_per_s_device"]]
    return {
        "median_step_s": round(median, 4), "step_s_min": round(min(timed), 4), "step_s_max": round(max(timed), 4),
        "timed_steps": len(timed), "tokens_per_step": tokens, "tokens_per_s": round(tokens / median, 1),
        "maxtext_tflops_per_s_device_median": round(statistics.median(tflops_dev), 2) if tflops_dev else None,
        "maxtext_tflops_per_step": last(r"Total TFLOPs: ([\d.]+)"),
        "maxtext_parameters_billion": last(r"number parameters: ([\d.]+) billion"),
        "maxtext_memory_estimate": last(r"(Total estimated memory size: [^\n]*)", number=False),
        "last_loss": steps[-1]["loss"], "maxtext_config": config,
        "jax": last(r"System Information: Jax Version: (\S+)", number=False),
        "backend": last(r"Jax Backend: (\S+)", number=False),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result", required=True, help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--wheels", default=f"{os.path.join(REPO, '.whl', 'peer')},{os.path.join(REPO, '.whl')}",
                        help="comma-separated wheel folders, installed first (the first folder's wheel wins)")
    parser.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "jaxtron-peer-site"),
                        help="folder the wheels are installed into (replaced)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the trainer")
    parser.add_argument("--attention", default=None, help="cudnn_flash_jax on a GPU, dot_product with --smoke")
    parser.add_argument("--remat", default="minimal_with_context", help="MaxText remat_policy")
    parser.add_argument("--vocab-tiling", type=int, default=8, help="MaxText num_vocab_tiling")
    parser.add_argument("--xla-flags", default=MAXTEXT_XLA_FLAGS, help="XLA_FLAGS of the trainer")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="another MaxText override (repeatable)")
    parser.add_argument("--no-fallback", action="store_true",
                        help="no retry with remat full (out of memory) or attention=dot_product (other errors)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for one attempt (480; 300 --smoke)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all attempts (600; 400 --smoke)")
    parser.add_argument("--log", default=None, help="the trainer's output (default: RESULT with .log)")
    args = parser.parse_args(argv)
    attention = args.attention or ("dot_product" if args.smoke else "cudnn_flash_jax")
    timeout = args.timeout or (300.0 if args.smoke else 480.0)
    budget = args.budget or (400.0 if args.smoke else 600.0)
    log_path = args.log or os.path.splitext(args.result)[0] + ".log"
    os.makedirs(os.path.dirname(os.path.abspath(args.result)), exist_ok=True)
    start = time.monotonic()
    result: dict = {"peer": "maxtext", "smoke": args.smoke, "entry": f"python -m {ENTRY} {CONFIG} KEY=VALUE ...",
                    "shape": {"model": "llama3-8b dimensions", **(SMOKE_SHAPE if args.smoke else SHAPE),
                              "global_batch": (SMOKE_SHAPE if args.smoke else SHAPE)["per_device_batch_size"]},
                    "steps": args.steps, "skipped_steps": SKIP_STEPS, "log": log_path}

    def finish(error: str | None) -> int:
        result["status"] = "ok" if error is None else "failed"
        if error is not None:
            result["error"] = " ".join(error.split())
        result["wall_s"] = round(time.monotonic() - start, 1)
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"peer_maxtext: {result['status']}" + (f": {result['error']}" if error else
              f", median step {result['median_step_s']} s, {result['tokens_per_s']} tokens/s") + f" -> {args.result}")
        return 0 if error is None else 1

    try:
        with open(log_path, "w", encoding="utf-8") as log:
            env = dict(os.environ)
            for k, v in ENV.items():
                env.setdefault(k, v)
            env["XLA_FLAGS"] = args.xla_flags
            env.setdefault("JAX_PLATFORMS", "cpu" if args.smoke else "cuda")
            if args.smoke:
                env["JAX_PLATFORMS"] = "cpu"
            wheels = install_wheels([d for d in args.wheels.split(",") if d], args.site, args.python, log)
            result["wheels"] = wheels
            if wheels["status"] not in ("installed", "none found"):
                return finish(f"installing the wheels of {args.wheels} failed: {wheels['status']} (see {log_path})")
            site = wheels.get("target")
            paths = [p for p in (site, env.get("PYTHONPATH", "")) if p]
            env["PYTHONPATH"] = os.pathsep.join(paths)
            stub_dir = args.site.rstrip("/") + "-stubs"
            shutil.rmtree(stub_dir, ignore_errors=True)
            missing = missing_modules(args.python, env, ["maxtext", *STUBS])
            if "maxtext" in missing:
                return finish("maxtext is not installed: run scripts/peer_wheels.sh (and scripts/gpu_wheels.sh) "
                              f"where PyPI can be reached, or pass --wheels (looked in {args.wheels})")
            if missing:
                write_stubs(stub_dir, missing)
                env["PYTHONPATH"] = os.pathsep.join([*paths, stub_dir])  # last: a real package always wins
            result["stubs"] = {n: STUBS[n][1] for n in missing}
            result["maxtext_version"] = maxtext_version(([site] if site else []) + sys.path)
            result["env"] = {k: env[k] for k in (*ENV, "XLA_FLAGS", "JAX_PLATFORMS")}
            plan = [(attention, args.remat)]
            attempts = []
            while plan:
                attn, remat = plan.pop(0)
                left = budget - (time.monotonic() - start)
                if left < 60:
                    break
                a = run_attempt(args, args.python, env, attn, remat, min(timeout, left), log)
                attempts.append(a)
                if "error" not in a:
                    break
                if args.no_fallback or len(attempts) >= 3:
                    continue
                oom = re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory", a["text"])
                if oom and remat != "full":
                    plan = [(attn, "full")]
                elif not oom and attn != "dot_product" and not a["steps"]:
                    plan = [("dot_product", remat)]
        result["attempts"] = [{k: v for k, v in a.items() if k != "text"} for a in attempts]
        if not attempts:
            return finish(f"no time left in the {budget:.0f} s budget to start MaxText")
        last = attempts[-1]
        result["attention"], result["remat_policy"] = last["attention"], last["remat_policy"]
        result["argv"] = last["argv"]
        if len(attempts) > 1:  # measured with a fallback: say what the first choice hit
            result["fallback_from"] = {"attention": attempts[0]["attention"],
                                       "remat_policy": attempts[0]["remat_policy"], "error": attempts[0]["error"]}
        if "error" in last:
            return finish(last["error"])
        result.update(summarize(args, last))
        return finish(None)
    except Exception as e:  # noqa: BLE001 - the JSON must say what went wrong
        return finish(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
