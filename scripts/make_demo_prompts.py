#!/usr/bin/env python3
"""The SmolLM2 demo's prompts (configs/demo-smollm2.yaml): short instructions from 8 templates x 115
everyday topics. The 16 evaluation topics are held out: no training prompt mentions them (the
templates are shared).

    # writes smol_chats.jsonl (792) + smol_eval_prompts.jsonl (32)
    python scripts/make_demo_prompts.py src/eagle3/assets
"""

import json
import random
import sys

topics = """photosynthesis|the water cycle|gravity|volcanoes|earthquakes|the moon|the solar system|
rainbows|clouds|ocean tides|the human heart|sleep|vitamins|exercise|bees|honey|coffee|tea|
bread|cheese|chocolate|bicycles|trains|airplanes|ships|the internet|email|passwords|
computers|smartphones|batteries|electricity|magnets|light bulbs|solar panels|wind turbines|
recycling|composting|gardening|tomatoes|apple trees|forests|deserts|rivers|mountains|
glaciers|penguins|elephants|dolphins|owls|cats|dogs|horses|butterflies|ants|spiders|
dinosaurs|fossils|the pyramids|ancient Rome|the printing press|maps|compasses|clocks|
calendars|money|banks|saving money|budgeting|taxes|libraries|books|poetry|music|the piano|
the guitar|painting|photography|cinema|football|basketball|chess|swimming|running|yoga|
meditation|friendship|teamwork|public speaking|writing a letter|job interviews|
learning a language|studying for exams|time management|cooking pasta|baking cookies|
making soup|camping|hiking|packing a suitcase|first aid|washing hands|brushing teeth|stars|
comets|black holes|atoms|DNA|vaccines|antibiotics|the immune system|weather forecasts|snow|
thunderstorms|wildfires""".replace("\n", "")
topics = [t.strip() for t in topics.split("|") if t.strip()]
templates = [
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a few sentences.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t} for a child.",
    "Why is {t} important?",
    "List some tips related to {t}.",
    "Describe {t} in two or three sentences.",
    "Write a short poem about {t}.",
]
rng = random.Random(0)
rng.shuffle(topics)
n_eval_topics = 16
eval_topics, train_topics = topics[:n_eval_topics], topics[n_eval_topics:]
train = [
    {"id": f"smol-{i}", "messages": [{"role": "user", "content": tpl.format(t=t)}]}
    for i, (t, tpl) in enumerate((t, tpl) for t in train_topics for tpl in templates)
]
rng.shuffle(train)
ev = [
    {"prompt": templates[(i * 3) % len(templates)].format(t=t)} for i, t in enumerate(eval_topics)
]
ev += [
    {"prompt": templates[(i * 3 + 5) % len(templates)].format(t=t)}
    for i, t in enumerate(eval_topics)
]
out = sys.argv[1]
with open(f"{out}/smol_chats.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in train)
with open(f"{out}/smol_eval_prompts.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in ev)
print(len(train), len(ev))
