"""Write the prompt sets the EAGLE-3 trainer uses: data/prompts/train.jsonl and heldout.jsonl.

Chat questions, code tasks and prose requests, built from templates over subjects. The held-out set
uses subjects and code tasks that never occur in the training set, so a held-out prompt shares
templates (the style of request) with training but not its content. Deterministic: rerunning this
writes the same files.

    python scripts/make_prompts.py [--train 3000] [--heldout 200]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SUBJECTS = """
volcanoes; black holes; the water cycle; photosynthesis; the Roman Empire; the printing press; honeybees;
coral reefs; the immune system; jazz music; the French Revolution; electric cars; solar panels; glaciers;
the stock market; inflation; vaccines; the moon landing; dinosaurs; the internet; coffee; chess; origami;
the Great Wall of China; rainforests; earthquakes; the human heart; sleep; meditation; the Olympic Games;
the Renaissance; ancient Egypt; tea; bicycles; trains; airplanes; submarines; lighthouses; bread baking;
cheese making; recycling; climate change; wind turbines; nuclear power; the periodic table; magnets;
rainbows; thunderstorms; hurricanes; deserts; penguins; elephants; octopuses; wolves; owls; butterflies;
mushrooms; trees; the ocean tides; the solar system; Mars; comets; telescopes; microscopes; DNA;
antibiotics; the brain; memory; languages; writing systems; libraries; museums; the violin; the piano;
painting; photography; cinema; video games; board games; football; basketball; marathon running; yoga;
gardening; composting; beekeeping; sailing; mountain climbing; camping; maps; compasses; clocks;
calendars; money; banks; taxes; democracy; the United Nations; city planning; bridges; skyscrapers;
roads; electricity; batteries; computers; smartphones; artificial intelligence; robots; 3D printing;
cryptography; passwords; email; social media; newspapers; radio; television; podcasts; public speaking;
job interviews; saving money; cooking pasta; healthy breakfasts; drinking water; first aid; friendship;
teamwork; leadership; time management; learning a new language; studying for exams; writing an essay;
moving to a new city; adopting a dog; caring for a cat; houseplants; knitting; pottery; woodworking;
the Silk Road; the Vikings; the Industrial Revolution; the Cold War; the Amazon river; the Sahara;
Antarctica; the Himalayas; Iceland; Japan; Brazil; Kenya; Canada; Italian cooking; spices; chocolate;
ice cream; vegetables; fruit trees; soil; worms; frogs; sharks; whales; dolphins; eagles; crows; ants;
spiders; snakes; horses; cows; sheep; farming; irrigation; fishing; forests; wildfires; floods; snow;
""".replace("\n", " ")

HELDOUT_SUBJECTS = """
the Eiffel Tower; hot air balloons; glass making; the Moon's phases; kangaroos; the Andes; bonsai trees;
lightning rods; the Panama Canal; fireflies; sourdough starters; the abacus; tsunamis; the harp;
seahorses; the Northern Lights; quilting; the Dead Sea; sundials; hedgehogs; marathon training plans;
the metric system; paper money; carnivorous plants; the Mariana Trench; jellyfish; stained glass;
the Hubble telescope; salt; umbrellas
""".replace("\n", " ")

CODE_TASKS = """
reverses a string; checks whether a number is prime; computes the factorial of n; finds the largest
element in a list; counts the vowels in a sentence; merges two sorted lists; removes duplicates from a
list while keeping order; returns the n-th Fibonacci number; checks whether a word is a palindrome;
converts Celsius to Fahrenheit; sums the digits of an integer; flattens a nested list; computes the
average of a list of numbers; finds the second smallest number in a list; capitalizes every word in a
sentence; counts how often each word appears in a text; checks whether two strings are anagrams;
returns the greatest common divisor of two numbers; rotates a list by k positions; finds all even
numbers in a list; converts a binary string to an integer; validates an email address with a simple
rule; splits a list into chunks of size n; returns the intersection of two lists; computes a running
total of a list; sorts a list of dictionaries by a key; reads a text file and counts its lines;
implements binary search; transposes a matrix; checks whether brackets in a string are balanced
""".replace("\n", " ")

HELDOUT_CODE_TASKS = """
returns the longest word in a sentence; computes the median of a list; checks whether a year is a leap
year; converts a Roman numeral to an integer; finds the missing number in a list from 1 to n;
interleaves two lists; counts the uppercase letters in a string; returns the product of a list of
numbers
""".replace("\n", " ")

CHAT = [
    "What is {s}?", "Can you explain {s} to a ten-year-old?", "Tell me three interesting facts about {s}.",
    "Why is {s} important?", "What are the main benefits and drawbacks of {s}?",
    "How would you describe {s} in one paragraph?", "What should a beginner know about {s}?",
    "Give me a short history of {s}.", "What are some common misconceptions about {s}?",
    "How does {s} affect everyday life?", "Write a list of five questions a student might ask about {s}.",
    "Summarize what you know about {s} in three sentences.", "What is the most surprising thing about {s}?",
    "Compare {s} with something more familiar.", "I want to learn about {s}. Where should I start?",
]
PROSE = [
    "Write a short story about {s}.", "Write a poem about {s}.", "Write a haiku about {s}.",
    "Write a friendly email to a friend about {s}.", "Write a product description inspired by {s}.",
    "Describe {s} as if you were a tour guide.", "Write a diary entry from someone who just discovered {s}.",
    "Write the opening paragraph of a novel set around {s}.", "Write a short speech about {s}.",
    "Write a children's bedtime story that involves {s}.",
]
CODE = [
    "Write a Python function that {t}.", "Write a Python function that {t}. Add a docstring and an example.",
    "How would I write a JavaScript function that {t}?", "Show me a short Python program that {t}, and explain it.",
    "Write a function in Python that {t}, and write two test cases for it.",
]


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(";") if x.strip()]


def build(subjects, tasks, n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    pool = ([("chat", t.format(s=s)) for t in CHAT for s in subjects]
            + [("prose", t.format(s=s)) for t in PROSE for s in subjects]
            + [("code", t.format(t=k)) for t in CODE for k in tasks])
    rnd.shuffle(pool)
    return [{"category": c, "text": t} for c, t in pool[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "data" / "prompts"))
    args = ap.parse_args()
    train_subjects, held_subjects = _split(SUBJECTS), _split(HELDOUT_SUBJECTS)
    assert not set(train_subjects) & set(held_subjects)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets = {"train": build(train_subjects, _split(CODE_TASKS), args.train, 0),
            "heldout": build(held_subjects, _split(HELDOUT_CODE_TASKS), args.heldout, 1)}
    for name, rows in sets.items():
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{out / name}.jsonl: {len(rows)} prompts")


if __name__ == "__main__":
    main()
