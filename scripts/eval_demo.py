"""A tiny evaluation for scripts/demo_campaign.sh: three chat completions through the `openai` package, against
whatever `pbstk run` points it at (OPENAI_BASE_URL and OPENAI_API_KEY in its environment). Exit code: $EVAL_EXIT."""

import os
import sys

from openai import OpenAI

client = OpenAI()
model = client.models.list().data[0].id
questions = ["What is two plus two?", "Name a prime number.", "Say hello to the cluster."]
for question in questions:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=16)
    usage = answer.usage
    tokens = f"{usage.prompt_tokens} prompt, {usage.completion_tokens} output tokens" if usage else "no usage"
    print(f"Q: {question}\nA: {answer.choices[0].message.content!r} ({tokens})")
print(f"{len(questions)}/{len(questions)} answered by {model} at {os.environ['OPENAI_BASE_URL']}")
sys.exit(int(os.environ.get("EVAL_EXIT", "0")))
