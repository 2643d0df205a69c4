import json, sys
import mlaserve

PROMPTS = [
    "def is_url(name: str) -> bool:\n    \"\"\"Return True if the name looks like a URL.\"\"\"",
    "def splitext(path: str) -> tuple[str, str]:\n    \"\"\"Like os.path.splitext, but take off .tar too\"\"\"",
    "class Link:\n    def __init__(self, url: str, comes_from: str | None = None) -> None:",
    "def read_chunks(file, size=io.DEFAULT_BUFFER_SIZE):\n    \"\"\"Yield pieces of data from a file-like object until EOF.\"\"\"",
]
if __name__ == "__main__":
    with mlaserve.Engine(device="cpu", dtype="float32") as engine:
        outs = engine.generate(prompt=PROMPTS, sampling_params={"max_new_tokens": 64, "temperature": 0})
    for p, o in zip(PROMPTS, outs):
        print("=" * 60); print(p + o["text"])
    json.dump([{"prompt": p, "completion": o["text"]} for p, o in zip(PROMPTS, outs)], open("/tmp/completions.json", "w"), indent=1)
