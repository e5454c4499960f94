"""A Molt chat agent (`AgentRunner(ChatAgentRunner)`), written against Molt's interface and the `openai` package only:
it sends the data set's messages to the policy through the OpenAI API, once, and its reward is the share of vowels
in the answer; its length goes to `info` (tests/ppo/test_molt_quick_start.py runs it with Molt's quick-start
recipe)."""

from molt.agents import ChatAgent, ChatAgentRunner, Result
from openai import AsyncOpenAI


class VowelChat(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=120)
        reply = await client.chat.completions.create(
            model=ctx.model_name, messages=list(ctx.messages), max_tokens=ctx.sampling_params.max_tokens
        )
        text = reply.choices[0].message.content or ""
        return Result(reward=sum(c in "aeiou" for c in text) / max(1, len(text)), info={"chars": len(text)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(VowelChat)
