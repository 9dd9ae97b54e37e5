"""Prompt text for tests and benchmarks: prompts of exact token lengths are slices of it."""

from __future__ import annotations

PARAGRAPHS = (
    "The harbour town woke slowly. Fishing boats came back before dawn, their holds full of mackerel "
    "and cod, and the market opened at six. Merchants argued over prices while gulls circled above the "
    "stalls. By eight o'clock the bakery had sold its first three hundred loaves, and the school bell "
    "rang across the square.",
    "A distributed system is a collection of independent computers that appears to its users as a "
    "single coherent system. Machines fail, networks partition, and clocks drift, so every protocol "
    "must state what it guarantees when a message is lost, delayed or delivered twice. Consensus "
    "algorithms such as Paxos and Raft keep replicated logs consistent despite such failures.",
    "To bake a simple loaf of bread, mix 500 grams of flour, 350 millilitres of warm water, 10 grams of "
    "salt and 7 grams of dried yeast. Knead the dough for ten minutes until it is smooth and elastic, "
    "then let it rise for an hour in a warm place. Shape it, let it rise again, and bake at 220 degrees "
    "Celsius for thirty-five minutes.",
    "The committee met on Tuesday to review the budget for the coming year. Spending on roads would "
    "rise by four percent, the library would open on Sundays, and a new bus route would connect the "
    "northern villages to the hospital. Several members asked for a report on the cost of repairing "
    "the old bridge before the winter floods.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, "
    "chlorophyll absorbs red and blue light, water molecules are split, and oxygen is released. The "
    "energy captured is stored in ATP and NADPH, which the Calvin cycle then uses to fix carbon dioxide "
    "into sugars that feed the whole plant.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < "
    "len(right):\n        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n"
    "        else:\n            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
    "The expedition set out from the last village on the river in early spring. Twelve porters carried "
    "food for forty days, two tents, ropes, and the instruments the surveyors needed to map the valley. "
    "On the third day the path vanished under a landslide, and they spent a week cutting a new track "
    "along the cliffs above the water.",
    "Interest rates affect almost every part of an economy. When a central bank raises its rate, loans "
    "become more expensive, households borrow less, and companies delay investment. Prices then rise "
    "more slowly. When the bank lowers the rate, the opposite happens, although the effects take many "
    "months to appear in the data.",
)

CORPUS = "\n\n".join(
    PARAGRAPHS[i % len(PARAGRAPHS)] for i in (0, 1, 2, 3, 4, 5, 6, 7, 3, 0, 6, 1, 7, 2, 5, 4, 5, 2, 7, 0, 4, 1, 6, 3)
)

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
)


def prompt_of_length(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``num_tokens`` token ids cut from the corpus, starting ``offset`` tokens in."""
    ids = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    if offset + num_tokens > len(ids):
        raise ValueError(f"corpus has {len(ids)} tokens, asked for {offset}+{num_tokens}")
    return list(ids[offset : offset + num_tokens])
