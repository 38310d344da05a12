"""Does ``plait plan`` size every architecture plait trains? Its estimate (layout plan, activation trace on the
meta device, memory, traffic, step time) for each decoder-only causal LM of the installed transformers, from the
tiny config plait-transformers derives (as scripts/architecture_sweep.py builds them), at dp=2 and at tp=2 with SP.

    python scripts/plan_sweep.py [--only qwen3 gemma4 ...] [--image-text]

``--image-text``: the image-text-to-text types instead, from the tiny configs scripts/vision_sweep.py builds.

Prints one line per architecture and layout that does not end in an estimate, and per layout the count of
estimates and of plait's refusals (one line each: the layout's own, as ``plait train`` refuses it; experts modules
of a model's own, which the planner does not stand in for; a forward that needs values on the meta device). An
exception of any other kind is a bug, listed as CRASH. Runs in one process on meta models: about 30 s.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from pathlib import Path

LAYOUTS = {"dp2": ({}, 2), "tp2-sp": ({"tp": 2}, 2)}


def outcome(model_type: str, layout: dict, world: int, image_text: bool = False) -> str:
    """'ok', 'refused: ...' (plait's ConfigError or AdapterError) or 'CRASH Type: ...'."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from plait import AdapterError, ParallelConfig
    from plait.base.config import ConfigError
    from plait.base.meta import build_meta_model
    from plait.costs.activations import trace_activations
    from plait.costs.estimate import Batch, estimate_layout
    from plait.costs.memory import Precision
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry
    from plait_transformers.tiny import tiny_config

    registry = default_registry()
    try:
        if image_text:
            from plait_transformers.vision_parity import sweep_config

            config = sweep_config(model_type)
        else:
            config = tiny_config(CONFIG_MAPPING[model_type])
        model = build_meta_model(config)
    except Exception as err:  # noqa: BLE001  (a config the tiny deriver cannot build: not the planner's)
        return f"no tiny model: {type(err).__name__}"
    try:
        plan = plan_layout(model, ParallelConfig(**layout), world, registry)
        positions = getattr(config.get_text_config(), "max_position_embeddings", None)
        seq = min(16, positions) if positions and positions > 0 else 16  # XLNet's -1: no limit
        estimate_layout(model, plan, Batch(1, seq), Precision(), trace_activations(model, seq, registry, plan.adapter))
        return "ok"
    except (ConfigError, AdapterError) as err:
        return f"refused: {' '.join(str(err).split())[:200]}"
    except Exception as err:  # noqa: BLE001  (what this script exists to find)
        return f"CRASH {type(err).__name__}: {' '.join(str(err).split())[:200]}"


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these architectures only")
    parser.add_argument("--image-text", action="store_true", help="the image-text-to-text types")
    ns = parser.parse_args()
    warnings.filterwarnings("ignore")
    if ns.image_text:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as names
    else:
        names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = ns.only or sorted(names)
    counts: dict[str, Counter] = {name: Counter() for name in LAYOUTS}
    for model_type in types:
        for name, (layout, world) in LAYOUTS.items():
            found = outcome(model_type, layout, world, ns.image_text)
            kind = found.split(":")[0].split(" ")[0]
            counts[name][kind] += 1
            if kind != "ok":
                print(f"{model_type} {name}: {found}")
    print()
    for name, counter in counts.items():
        print(f"{name}: " + ", ".join(f"{kind} {n}" for kind, n in sorted(counter.items())))
    return 1 if any(counter["CRASH"] for counter in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
