"""The gates' answers from serving's kind of engine against Hugging Face `generate`'s, on a demo run.

For the run's candidate (models/policy) and reference (models/sft): the greedy answers to the
gates' first look (the first `gates.eval_prompts` eval prompts and the first look of each
regression suite) from Hugging Face `generate` in fp32, and from a vLLM engine as serving opens
it (`factory.open_serving_engine`) in each dtype asked for; how many answers differ from the
Hugging Face ones, the eval prompts' accuracy of each, and the seconds (engine start included).
Then the gate stage's whole comparison (`gate_models.evaluate_on`) with the run's config: its
seconds and decision, beside the decision the run itself recorded.

    python bench/gate_answers.py [--run runs/demo-...] [--config configs/demo.yaml] [--dtypes float32 bfloat16]

Writes bench/results/gate_answers.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NO_DEMO_RUN, newest_demo_run, save  # noqa: E402


def first_look(run: Path, cfg) -> tuple[list[str], list[str], list[str], list]:
    """(the eval prompts, their answers, the first look's prompts: eval and suites', the suites)."""
    from rlhf_core.data.schema import read_table  # noqa: PLC0415
    from rlhf_core.eval.gate_models import answer_tiers  # noqa: PLC0415
    from rlhf_core.eval.regression import load_suites  # noqa: PLC0415

    evals = read_table(run / "data" / "eval.jsonl")
    prompts, answers = list(evals["prompt"]), list(evals["answer"])
    suites = load_suites(cfg.gates.regression_suites, run / "data", cfg.data.demo, exclude=prompts)
    return prompts, answers, list(answer_tiers(prompts, suites, cfg)[0]), suites


def answers_of(model_dir: Path, asked: list[str], cfg, dtypes: list[str]) -> dict:
    from rlhf_core.eval.accuracy import greedy_completions  # noqa: PLC0415
    from rlhf_core.eval.gate_models import served_answers  # noqa: PLC0415
    from rlhf_core.models.llama import load_policy  # noqa: PLC0415
    from rlhf_core.rollout.factory import open_serving_engine  # noqa: PLC0415
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    start = time.perf_counter()
    hf = greedy_completions(load_policy(model_dir), load_tokenizer(model_dir), asked, cfg.policy.max_new_tokens)
    out = {"hf_float32": {"seconds": time.perf_counter() - start, "texts": hf}}
    for dtype in dtypes:
        serving = cfg.serving.model_copy(update={"dtype": dtype})

        def opener(path, seqs, length, serving=serving):
            return open_serving_engine(path, serving, torch.device("cpu"), max_num_seqs=seqs, max_model_len=length)

        start = time.perf_counter()
        served = served_answers(model_dir, (tuple(asked),), opener, cfg).answer(asked, cfg.policy.max_new_tokens)
        out[f"vllm_{dtype}"] = {"seconds": time.perf_counter() - start, "texts": served.texts,
                                "failed": len(served.failed_prompts),
                                "differ_from_hf": sum(a != b for a, b in zip(served.texts, hf))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a finished demo run (default: the newest under runs/)")
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--name", default="gate_answers", help="result file bench/results/NAME.json")
    args = parser.parse_args()
    run = args.run or newest_demo_run()
    if run is None:
        print(NO_DEMO_RUN, file=sys.stderr)
        return 2
    from rlhf_core.config import load_config  # noqa: PLC0415
    from rlhf_core.eval.gate_models import GateModels, evaluate_on  # noqa: PLC0415
    from rlhf_core.eval.gates import gate  # noqa: PLC0415
    from rlhf_core.models.reward import current_audit_dir  # noqa: PLC0415
    from rlhf_core.training.verifiable import check_answers  # noqa: PLC0415

    cfg = load_config(args.config)
    prompts, answers, asked, suites = first_look(run, cfg)
    n_eval = min(cfg.gates.eval_prompts, len(prompts))
    result: dict = {"run": str(run), "asked": len(asked), "eval_prompts": n_eval, "policies": {}}
    for name, model_dir in (("candidate", run / "models" / "policy"), ("reference", run / "models" / "sft")):
        by = answers_of(model_dir, asked, cfg, args.dtypes)
        for kind, row in by.items():
            texts = row.pop("texts")
            row["accuracy"] = sum(check_answers(prompts[:n_eval], texts[:n_eval], answers[:n_eval],
                                                cfg.data.answer_checker)) / n_eval
            print(f"{name:9s} {kind:15s} {row['seconds']:6.1f} s  accuracy {row['accuracy']:.3f}"
                  + (f"  differ from HF: {row['differ_from_hf']}/{len(asked)}" if "differ_from_hf" in row else ""),
                  flush=True)
        result["policies"][name] = by
    models = GateModels(run / "models" / "policy", run / "models" / "sft", run / "models" / "reward",
                        audit=current_audit_dir(run / "models" / "policy", run / "models" / "reward"))
    start = time.perf_counter()
    evaluated = evaluate_on(torch.device("cpu"), models, prompts, answers, cfg, suites)
    seconds = time.perf_counter() - start
    decision = gate(evaluated.candidate.figures, evaluated.reference.figures, None, cfg.gates)
    recorded = json.loads((run / "gate_report.json").read_text())["decision"]["status"]
    result["gates"] = {"seconds": seconds, "status": decision.status, "recorded_status": recorded,
                       "num_prompts": evaluated.num_prompts, "metrics": evaluated.metrics()}
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"gates (evaluate_on, serving.dtype {cfg.serving.dtype}): {seconds:.1f} s, {decision.status} on "
          f"{evaluated.num_prompts} prompts (the run recorded {recorded}); peak RSS {result['peak_rss_gib']:.2f} GiB")
    save(args.name, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
