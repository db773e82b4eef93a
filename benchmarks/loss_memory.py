"""Peak memory of one training step (forward + backward) of an mT5-vocabulary FAT5: the LM loss on full fp32
logits (`config.return_logits_in_training=True`, what FAT5 did before) against the chunked linear cross-entropy
(the default), with loss and gradients compared and both steps timed side by side.

Peaks are counted by torch's MemTracker (live tensor storages, 512-byte rounding, parameters and gradients
included). The full-logits step at 8,192 target tokens needs more memory than a small machine has, so by default
both steps are counted under FakeTensorMode (shapes and dtypes only, nothing allocated), the chunked step is also
run for real at full size to check the fake count, and loss, gradients and step time are compared in real runs
at `--check-tokens`.

    python benchmarks/loss_memory.py                # mT5 vocabulary, 8,192 target tokens (CPU or GPU)
    python benchmarks/loss_memory.py --smoke        # seconds: small vocabulary and batch
"""

import platform
import sys
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402

import common  # noqa: E402
from fat5.configuration_fat5 import FAT5Config  # noqa: E402
from fat5.modeling_fat5 import FAT5ForConditionalGeneration  # noqa: E402

ENCODER_LENGTH = 64
DECODER_LENGTH = 1024
STEPS = {"full fp32 logits": True, "chunked (default)": False}


def build(vocab_size, d_model, target_tokens, seed=0):
    config = FAT5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=1,
                        num_heads=2, dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                        z_loss=1e-4)
    torch.manual_seed(seed)
    model = FAT5ForConditionalGeneration(config).train()
    batch_size = max(1, target_tokens // DECODER_LENGTH)
    decoder_length = target_tokens // batch_size
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(2, vocab_size, (batch_size, decoder_length), generator=generator)
    labels[:, -decoder_length // 8:] = -100  # padding in every row
    batch = dict(input_ids=torch.randint(2, vocab_size, (batch_size, ENCODER_LENGTH), generator=generator),
                 attention_mask=torch.ones(batch_size, ENCODER_LENGTH, dtype=torch.long), labels=labels)
    return model, batch


def step(model, batch, full_logits):
    model.config.return_logits_in_training = full_logits
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss


def tracked_peak(model, batch, full_logits):
    with MemTracker() as tracker:
        tracker.track_external(model)
        step(model, batch, full_logits)
        peak = tracker.get_tracker_snapshot("peak")
    return max(snapshot["Total"] for snapshot in peak.values())


def fake_peaks(vocab_size, d_model, tokens):
    with FakeTensorMode():
        model, batch = build(vocab_size, d_model, tokens)
        return {name: tracked_peak(model, batch, full) for name, full in STEPS.items()}


def compare(vocab_size, d_model, tokens, reps):
    """Relative differences of loss and of every gradient, chunked vs full logits, and the median milliseconds
    of each step (real fp32 run, one process)."""
    model, batch = build(vocab_size, d_model, tokens)
    results, step_ms = {}, {}
    for name, full in STEPS.items():
        loss = step(model, batch, full)
        results[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        step_ms[name] = common.time_ms(lambda full=full: step(model, batch, full), reps, warmup=1)
    (loss_full, grads_full), (loss_chunked, grads_chunked) = results.values()
    worst = max(((grads_chunked[n] - g).abs().max() / g.abs().max()).item() for n, g in grads_full.items())
    return {"loss_full": loss_full.item(), "loss_chunked": loss_chunked.item(),
            "loss_relative_difference": abs((loss_chunked - loss_full) / loss_full).item(),
            "max_gradient_relative_difference": worst, "step_ms": step_ms,
            "speed_chunked_over_full": step_ms["full fp32 logits"] / step_ms["chunked (default)"]}


def liger_check(vocab_size, d_model, tokens, reps):
    """liger-kernel's fused loss (`lm_loss_implementation="liger"`) against the chunked one in real CUDA steps:
    loss and largest gradient differences, median step time, CUDA allocator peak of a step. A string saying why
    not where there is no CUDA or no liger-kernel."""
    if not torch.cuda.is_available():
        return "not measured: no CUDA (liger-kernel runs on CUDA only)"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "not measured: liger-kernel is not installed (pip install 'fat5[liger]')"
    model, batch = build(vocab_size, d_model, tokens)
    model.cuda()
    batch = {name: tensor.cuda() for name, tensor in batch.items()}
    runs = {}
    for implementation in ("chunked", "liger"):
        model.config.lm_loss_implementation = implementation
        with common.peak_memory() as peak:
            loss = step(model, batch, full_logits=False)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        ms = common.time_ms(lambda: step(model, batch, full_logits=False), reps, warmup=1)
        runs[implementation] = (loss.detach(), grads, ms, peak["mib"])
    (loss, grads, ms, peak), (liger_loss, liger_grads, liger_ms, liger_peak) = runs.values()
    worst = max(((liger_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in grads.items())
    return {"loss_relative_difference": abs((liger_loss - loss) / loss).item(),
            "max_gradient_relative_difference": worst, "step_ms": {"chunked": ms, "liger": liger_ms},
            "peak_mib": {"chunked": peak, "liger": liger_peak}}


def main():
    parser = common.argument_parser(__doc__, output=True)
    parser.add_argument("--vocab-size", type=common.positive_int, default=250112,
                        help="vocabulary (the LM head's rows; 250112 is mT5's)")
    parser.add_argument("--d-model", type=common.positive_int, default=32, help="model width")
    parser.add_argument("--tokens", type=common.positive_int, default=8192, help="target tokens per step")
    parser.add_argument("--check-tokens", type=common.positive_int, default=1024,
                        help="tokens of the real loss/gradient check")
    parser.add_argument("--reps", type=common.positive_int, default=5,
                        help="timed steps of each kind at --check-tokens")
    args = parser.parse_args()
    if args.smoke:
        args.vocab_size, args.tokens, args.check_tokens, args.reps = 5000, 2048, 256, 1
    start = time.time()
    settings = {"vocab_size": args.vocab_size, "d_model": args.d_model, "target_tokens": args.tokens,
                "check_tokens": args.check_tokens, "transformers": transformers.__version__,
                "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"}
    rows = common.Rows("loss_memory", settings, args.out)
    peaks = fake_peaks(args.vocab_size, args.d_model, args.tokens)
    model, batch = build(args.vocab_size, args.d_model, args.tokens)
    real_chunked = tracked_peak(model, batch, full_logits=False)
    del model, batch
    full, chunked = peaks["full fp32 logits"], peaks["chunked (default)"]
    rows.append({"part": "peaks", "peak_bytes": peaks, "chunked_peak_bytes_real_run": real_chunked,
                 "ratio_full_over_chunked": full / chunked})
    check = compare(args.vocab_size, args.d_model, args.check_tokens, args.reps)
    rows.append({"part": "check", **check})
    liger = liger_check(args.vocab_size, args.d_model, args.check_tokens, args.reps)
    rows.append({"part": "liger", "liger": liger, "seconds": round(time.time() - start, 1)})
    gib = 2**30
    print(f"vocab {args.vocab_size}, {args.tokens} target tokens, d_model {args.d_model}")
    for name, peak in peaks.items():
        print(f"  {name:20s} peak {peak / gib:8.3f} GiB")
    print(f"  chunked, real run    peak {real_chunked / gib:8.3f} GiB")
    print(f"  full / chunked = {full / chunked:.1f}x")
    print(f"  real check at {args.check_tokens} tokens: loss rel diff {check['loss_relative_difference']:.2e}, "
          f"max gradient rel diff {check['max_gradient_relative_difference']:.2e}")
    timings = ", ".join(f"{name} {ms:.1f} ms" for name, ms in check["step_ms"].items())
    print(f"  step time at {args.check_tokens} tokens: {timings}; chunked is "
          f"{check['speed_chunked_over_full']:.2f}x the full-logits speed", flush=True)
    if isinstance(liger, str):
        print(f"  liger-kernel: {liger}")
    else:
        print(f"  liger-kernel on CUDA at {args.check_tokens} tokens: loss rel diff "
              f"{liger['loss_relative_difference']:.2e}, max gradient rel diff "
              f"{liger['max_gradient_relative_difference']:.2e}; step ms {liger['step_ms']}; peak MiB "
              f"{liger['peak_mib']}", flush=True)
    if not args.smoke and full < 4 * chunked:
        sys.exit(f"chunked peak {chunked / gib:.3f} GiB is more than 1/4 of the full-logits peak {full / gib:.3f} GiB")


if __name__ == "__main__":
    main()
