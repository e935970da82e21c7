"""Prompts for speculative decoding (bench/spec_bench.py and the default model's speculative tests): grounded tasks
over one passage given in the prompt (the output repeats spans of it) and free chat (it does not)."""

from __future__ import annotations

# ~400 tokens of the default model's tokenizer; a few misspellings for the rewrite task to correct
PASSAGE = (
    "The town of Halden sits where the river Tessel meets the sea. For three hundred years its harbour was the "
    "busiest on the coast: timber came down the river on rafts, was sawn into planks in the mills along the quay, "
    "and left on ships bound for the southern ports. In 1871 a fire destroyed most of the wooden warehouses, and "
    "the town council decided to rebuild them in brick. The new warehouses were longer and taller than the old ones, "
    "with iron cranes on the upper floors and rails that ran straight onto the piers. Trade grew again for a while, "
    "but the railway reached the valley in 1894, and the timber merchants began to send their wood by train "
    "instead of by sea. By 1920 only two of the seven mills were still working, and the harbour was used mostly by "
    "fishing boats. Today the brick warehouses hold a museum, a library, a school of boat building and a market "
    "that opens every Saturday morning. The musuem keeps the records of the old timber trade: ledgers, maps of the "
    "forests upstream, and photographs of the rafts, some of which were more than a hundred metres long. Visitors "
    "can walk along the quay from the lighthouse to the old customs house in about twenty minutes, and a small ferry "
    "crosses the river every half hour in summer. The town's population, which was about nine thousand in 1900, is "
    "now a little over twelve thousand. Most people work in the hospital, in the schools, or in the small "
    "companies that repair and build boats along the northern shore. Every year in August the town holds a festival "
    "in memory of the raftsmen, with music on the piers and a race of wooden boats from the bridge to the harbour "
    "mouth. The race was first held in 1903 and has been cancelled only twice, both times because of storms."
)

GROUNDED_TASKS = {
    "rewrite": "Rewrite the following text exactly, correcting any spelling mistakes. Output only the text.\n\n",
    "extract": "Copy every sentence of the following text that contains a year, one per line, word for word.\n\n",
    "continue": "Repeat the following text word for word.\n\n",
}

FREE_CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for learning a new language?",
    "Describe your ideal weekend in a few paragraphs.",
    "Explain how a bicycle stays upright when it moves.",
    "Invent a recipe for a soup made with autumn vegetables.",
    "Write a letter to a friend about a trip to the mountains.",
    "What makes a good teacher? Give several reasons.",
    "Tell me about the history of tea in a few paragraphs.",
]


def grounded_messages() -> dict[str, list[dict]]:
    """Each grounded task as a chat: the instruction, then the passage."""
    return {name: [{"role": "user", "content": task + PASSAGE}] for name, task in GROUNDED_TASKS.items()}


def chat_messages() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in FREE_CHAT]
