import json, urllib.request, sys
port = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))
text = open("docs/DESIGN.md").read()
paras = [p for p in text.split("\n\n") if len(p) > 600][:6]
messages = []
for turn, p in enumerate(paras):
    messages.append({"role": "user", "content": "Summarise this:\n" + p})
    r = post("/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0})
    u = r["usage"]
    print(f"turn {turn + 1}: prompt_tokens {u['prompt_tokens']}, cached_tokens {u.get('prompt_tokens_details', {}).get('cached_tokens')}")
    messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
print(json.dumps(json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/stats")).get("prefix_cache")))
