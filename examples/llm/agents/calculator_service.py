"""calculator_agent.py as an agent service: tidal (``rollout.agent.url``) POSTs
``{session_base_url, api_key, record}`` per episode and reads ``{"reward": r}``. The Agents SDK is
imported once, not per episode as a command pays it (about 4 s here).

    python examples/llm/agents/calculator_service.py --port 8931
"""

import argparse
import sys
from pathlib import Path

from aiohttp import web
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_agent import solve  # noqa: E402


async def episode(request: web.Request) -> web.Response:
    body = await request.json()
    client = AsyncOpenAI(base_url=body["session_base_url"], api_key=body["api_key"], max_retries=0)
    try:
        return web.json_response({"reward": await solve(body["record"], client)})
    finally:
        await client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8931)
    a = p.parse_args()
    app = web.Application()
    app.router.add_post("/", episode)
    web.run_app(app, host=a.host, port=a.port, print=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    main()
