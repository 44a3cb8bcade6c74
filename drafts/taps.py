"""Which target layers a draft reads (``capture_layer_ids``): one rule for every kind that taps the target.

draftsmith's id i is the output of decoder layer i (negative ids count from the top: -1 is the last). At
training time every kind takes ids that exist (0..L-1) and are strictly increasing: vLLM, SGLang, llama.cpp
and the peers' pipelines concatenate the tapped states in layer order, once each, so an order written
otherwise would only be re-sorted behind the user's back. The last layer is allowed while training: vLLM
captures its output (llama.py / qwen2.py add each layer's output as aux id ``i + 1``, up to L), and so does
draftsmith's own decoder. Engines that capture only the inputs of decoder layers (SGLang's
``layers_to_capture``, llama.cpp's ``extract_layer_inputs``) cannot hand it over; their records say so
(``Engine.captures_last_layer``) and export refuses such a draft with ``refuse_uncaptured_last_layer``.

Heads an earlier draftsmith saved with ids in another order still load and export (EAGLE-3's exporter
permutes ``fc``'s column blocks); only new training is held to the order.
"""

from __future__ import annotations

from draftsmith.drafts.engines import Engine

OPTION = "draft.options.capture_layer_ids"


def check_tap_layers(layer_ids: list[int], num_layers: int, option: str = OPTION) -> list[int]:
    """``layer_ids`` as 0-based ids of a target with ``num_layers`` decoder layers; a one-line error naming
    the ids and what to write instead when one does not exist, none is given, or they are not strictly
    increasing."""
    ids = [int(i) + num_layers if int(i) < 0 else int(i) for i in layer_ids]
    if not ids:
        raise ValueError(f"{option} is empty: the draft reads at least one target layer")
    bad = [given for given, i in zip(layer_ids, ids) if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"{option} {list(layer_ids)}: {bad} outside 0..{num_layers - 1} for a target with {num_layers} "
            "decoder layers (negative ids count from the last layer, -1)"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        why = f"layer {twice} read twice adds nothing; " if twice else ""
        raise ValueError(
            f"{option} {list(layer_ids)} must be strictly increasing ({why}serving engines concatenate the "
            f"tapped states in layer order, once each): write them as {sorted(set(ids))}"
        )
    return ids


def refuse_uncaptured_last_layer(layer_ids: list[int], num_layers: int, engine: Engine) -> None:
    """Refuse, naming the engine and what to do, a draft that reads the target's last layer when ``engine``
    captures only the inputs of decoder layers."""
    last = num_layers - 1
    if engine.captures_last_layer or last not in layer_ids:
        return
    raise ValueError(
        f"layer id {last} is the output of the target's last layer ({num_layers} layers): {engine.title} "
        f"captures only the inputs of decoder layers, so it can hand the draft outputs of layers 0..{last - 1}. "
        f"Export to vllm (which captures the last layer too), or train the draft with capture_layer_ids below "
        f"{last}."
    )
