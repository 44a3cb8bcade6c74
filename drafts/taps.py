"""Which target layers a feature-conditioned draft taps, and the one rule every kind that takes them from a
recipe holds them to (``draft.options.capture_layer_ids``): in range, never the last layer, strictly
increasing. vLLM captures a layer's output as the next layer's input, so the last layer's output is not on
offer to a parallel drafter, and the engines and peers concatenate taps in layer order, so an order that is
not theirs is refused naming the order to write, never reordered behind the user's back."""

from __future__ import annotations


def default_tap_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high (1, L/2 - 1, L - 4), or on a shallow target the first, middle and
    second-to-last; never the last."""
    if num_layers >= 7:
        return [1, num_layers // 2 - 1, num_layers - 4]
    return sorted({0, (num_layers - 1) // 2, max(num_layers - 2, 0)})


def check_tap_layers(layer_ids: list[int], num_layers: int, what: str = "draft") -> list[int]:
    """Tap layer ids (negative counts from the top) as 0-based ids, refusing in one line what an engine cannot
    read: none, out of range or the last layer, or not strictly increasing. ``what`` names the draft kind."""
    ids = [i + num_layers if i < 0 else int(i) for i in layer_ids]
    if not ids:
        raise ValueError(f"draft.options.capture_layer_ids: a {what} reads at least one target layer")
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise ValueError(
            f"draft.options.capture_layer_ids {layer_ids}: {bad} outside 0..{num_layers - 2} for a target with "
            f"{num_layers} decoder layers (vLLM captures a layer's output as the next layer's input, so the last "
            f"layer's output is not on offer to a {what})"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"draft.options.capture_layer_ids {layer_ids} must be strictly increasing (vLLM and the peers "
            f"concatenate taps in layer order): write them as {sorted(set(ids))}"
        )
    return ids
