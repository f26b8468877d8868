"""The paper's claims about LNS against Pre-LN, as paired verdicts on two arms' records, and how a verdict's effect
is written in a report."""
from __future__ import annotations

from utils.study import verdicts
from utils.study.measures import by_seed, document_measures

CORE_CLAIMS = [
    # (claim about LNS minus Pre-LN, measure, expected direction of (LNS - Pre-LN), compared as a log ratio)
    ("LNS reaches a lower eval loss than Pre-LN", "eval_loss", -1, False),
    ("Pre-LN's residual variance grows more with depth than LNS's (ratio of the growths)", "variance_growth", -1,
     True),
    ("Deep Pre-LN layers are closer to their successor: LNS's deep d(l, l+1) is larger", "angular_deep", +1, False),
    ("Deep Pre-LN blocks are closer to the identity: LNS's deep ‖J − I‖ is larger", "jacobian_deep", +1, False),
]
REMOVAL_CLAIM = "Removing a deep Pre-LN layer costs less than removing a deep LNS layer (nats/word)"
# ShortGPT's block influence, the fifth deep-layer measure (issue 39): judged where the records have it
BI_CLAIM = ("Deep Pre-LN layers change the stream less: LNS's deep block influence 1 − cos(h_l, h_l+1) is larger",
            "bi_deep", +1, False)
# The logit lens (issue 50), judged where the records have it: deep Pre-LN layers do less, so its prediction settles
# earlier in the depth and its deep layers' read-outs are already close to the final distribution.
LENS_CLAIMS = [
    ("Deep Pre-LN layers refine the prediction less: LNS's deep-half logit-lens KL from the final distribution is "
     "larger", "lens_kl_deep", +1, False),
    ("Pre-LN's prediction settles earlier in the depth: LNS's mean prediction depth / L is larger",
     "relative_prediction_depth", +1, False),
]


def one_shared_seed_documents(records, a: str, b: str) -> tuple[dict, dict] | None:
    """When arms a and b share exactly one finished seed and both runs kept per-document values: those values."""
    a_losses, b_losses = by_seed(records, a, "eval_loss"), by_seed(records, b, "eval_loss")
    seeds = [s for s, v in a_losses.items() if v is not None and b_losses.get(s) is not None]
    if len(seeds) != 1:
        return None
    found = [document_measures(records[f"{arm}-seed{seeds[0]}"]) for arm in (a, b)]
    return None if None in found else (found[0], found[1])


def documents_note(verdict: verdicts.Verdict, what: str) -> verdicts.Verdict:
    note = (f"one seed, so the interval is a bootstrap over {verdict.n_pairs} held-out documents of {what}; "
            "it holds the documents' noise, not the seed's")
    verdict.reason = f"{note}; {verdict.reason}" if verdict.reason else note
    return verdict


def loss_verdict(records, a: str, b: str, claim: str, labels: tuple[str, str], direction: int = -1,
                 documents_what: str = "the held-out novel's loss (nats/word, not the trainer's eval loss)"
                 ) -> verdicts.Verdict:
    """b's eval loss against a's, paired by seed; with one shared seed, the held-out loss per document instead
    (`documents_what` names it in the verdict's note). `labels` name the two arms."""
    verdict = verdicts.judge_seeds(claim, direction, by_seed(records, a, "eval_loss"), by_seed(records, b, "eval_loss"),
                                   labels)
    documents = one_shared_seed_documents(records, a, b) if verdict.status == verdicts.NOT_MEASURABLE else None
    if documents is None:
        return verdict
    return documents_note(verdicts.judge_documents(claim, direction, documents[0]["heldout_nats"],
                                                   documents[1]["heldout_nats"]),
                          documents_what)


def pair_verdicts(records, pre: str, lns: str, labels: tuple[str, str]) -> list[verdicts.Verdict]:
    """The core claims, the removal claim and (where the records have them) block influence and the logit lens: arm
    `lns` against arm `pre`, labelled by `labels`."""
    loss_claim, _, loss_direction, _ = CORE_CLAIMS[0]
    found = [loss_verdict(records, pre, lns, loss_claim, labels, loss_direction)]
    found += [verdicts.judge_seeds(claim, direction, by_seed(records, pre, measure), by_seed(records, lns, measure),
                                   labels, log_ratio=log_ratio)
              for claim, measure, direction, log_ratio in CORE_CLAIMS[1:]]
    found.append(verdicts.judge_layer_removal(REMOVAL_CLAIM, by_seed(records, pre, "removal_deep"),
                                              by_seed(records, lns, "removal_deep"), labels))
    documents = one_shared_seed_documents(records, pre, lns) if found[-1].status == verdicts.NOT_MEASURABLE else None
    if documents is not None:
        found[-1] = documents_note(verdicts.judge_layer_removal_documents(
            REMOVAL_CLAIM, documents[0]["removal_deep"], documents[1]["removal_deep"], labels),
            "the deep-half removal cost (nats/word)")
    for claim, measure, direction, log_ratio in [BI_CLAIM, *LENS_CLAIMS]:
        values = by_seed(records, pre, measure), by_seed(records, lns, measure)
        if any(v is not None for arm in values for v in arm.values()):
            found.append(verdicts.judge_seeds(claim, direction, *values, labels, log_ratio=log_ratio))
    return found


def effect_text(v: verdicts.Verdict) -> str:
    if v.effect is None:
        return v.status
    unit = "" if v.unit == "seeds" else f" {v.unit}"
    return f"{v.effect:+.4f} [{v.low:+.4f}, {v.high:+.4f}], {v.n_agree}/{v.n_pairs}{unit} ({v.status})"


def verdict_lines(found: list[verdicts.Verdict]) -> str:
    return "\n".join(f"- {v.line()}" for v in found)
