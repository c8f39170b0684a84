"""Refit the cross-encoder's blend for vectors of another embedding precision (development time).

    HF_HUB_OFFLINE=1 .venv/bin/python -m policies.cache.blend_refit --precision int8

The shipped blend (cross_encoder.json `blend`, policies/cache/cross_encoder_train.py) weighs the
cross-encoder's logit, the pair's bi-encoder cosine and the embedding-feature verifier's logit,
the last two read from float32 MiniLM vectors. Vectors of another precision move both a little
(int8: cosine to float32 0.997 median), and the verifier (an MLP over u*v and |u-v|) reads them
element by element. With that precision's verifier (`verifier_train --precision int8`, beside
the artifact) this fits the same blend, the same way, on the same pairs (the selection split
past the loosest gate, no rule veto; the cross-encoder's logits do not change), and records it
under `blends` in the artifact's meta, keyed by the vector space; the cache reads the blend (and
its verifier) of the space it runs in.
Test pairs are never looked at (bench/embedding_precision.py reports them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from policies.cache.cross_encoder import BUNDLED_CROSS_ENCODER, CrossEncoder, meta_path
from policies.cache.cross_encoder_train import (
    average_precision,
    choose,
    fit_blend,
    previous_probabilities,
    score,
    selection_past_gate,
)
from policies.cache.verifier_data import EmbeddingCache, load_all
from policies.cache.verify import VerifyConfig
from policies.embedding.embedder import vector_space

SOURCES = ("qqp", "stsb", "gptcache")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="int8", choices=["int8"])
    parser.add_argument("--artifact", type=Path, default=BUNDLED_CROSS_ENCODER)
    parser.add_argument("--verifier", type=Path, default=None,
                        help="the embedding-feature verifier fitted on this precision's vectors (beside the artifact; "
                             "default verifier-<precision>.npz, made by verifier_train --precision)")
    parser.add_argument("--embeddings", type=Path, default=Path("/tmp/tierlane_verifier/emb.npz"),
                        help="float32 vectors (load_all builds the pairs' negatives from them, as in training)")
    args = parser.parse_args(argv)
    started = time.time()
    space = vector_space(args.precision)
    fp32 = EmbeddingCache(args.embeddings)
    pairs = load_all(fp32)  # the same pairs and splits training used
    embed = EmbeddingCache.for_precision(args.embeddings, args.precision)
    cfg = VerifyConfig.from_policy({})
    selection, cosine, vetoed, y, source = selection_past_gate(pairs, embed, cfg)
    encoder = CrossEncoder(args.artifact)
    verifier = args.verifier or args.artifact.with_name(f"verifier-{args.precision}.npz")
    if verifier.parent != args.artifact.parent:
        parser.error("the verifier must sit beside the artifact (the blend names it by file name)")
    logits = score(encoder, selection)
    previous = previous_probabilities(selection, embed, cfg, verifier)
    shipped_previous = previous_probabilities(selection, embed, cfg)
    blend = fit_blend(logits[~vetoed], cosine[~vetoed], previous[~vetoed], y[~vetoed])
    blend["previous_verifier"] = verifier.name
    blend["vectors"] = space
    encoder.meta.setdefault("blends", {})[space] = blend
    prob = encoder.calibrate(logits, cosine, previous, space)
    shipped = encoder.calibrate(logits, cosine, shipped_previous)  # the float32 blend and verifier on these vectors
    chosen = choose(prob, cosine, vetoed, y, source)[0]
    blend["selection"] = {
        "pairs_past_gate": len(selection),
        "average_precision": {src: average_precision(prob[source == src], y[source == src]) for src in SOURCES},
        "average_precision_with_the_float32_blend_and_verifier": {src: average_precision(shipped[source == src], y[source == src])
                                                     for src in SOURCES},
        "chosen_as_in_training": {k: chosen[k] for k in ("gate", "vetoes", "min_probability")},
        "seconds": round(time.time() - started, 1),
    }  # fmt: skip
    path = meta_path(encoder.path)
    path.write_text(json.dumps(encoder.meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(json.dumps(blend, indent=1))
    print(f"wrote the {space} blend into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
