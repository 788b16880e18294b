"""The built-in workflows of ``rollout.workflow``, registered by name: each builds from a
``WorkflowContext`` (the run's config, inference client, tokenizer, sampling defaults and data).
``auto`` picks ``agent`` when an agent command or service is configured, else what the data
runs (``multi_turn`` for a multi-turn task, ``rlvr`` otherwise). An agent in tidal's process is
a user's ``rollout.workflow: module.path:factory`` returning ``in_process_agent(ctx, agent)``."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from tidal.config.llm import LLMConfig
from tidal.rollout.tasks import TASKS, is_multi_turn
from tidal.rollout.workflows import (
    WORKFLOWS,
    MultiTurnWorkflow,
    RLVRWorkflow,
    WorkflowContext,
    overlong_penalty,
)
from tidal.runners.llm.common import prompt_renderer, warmed_reward

if TYPE_CHECKING:  # the agent workflows need the 'agents' extra: imported where they are built
    from tidal.rollout.agent_command import ExternalAgentWorkflow
    from tidal.rollout.agent_workflow import AgentFn, AgentWorkflow


def workflow_name(cfg: LLMConfig) -> str:
    r = cfg.rollout
    if r.workflow != "auto":
        return r.workflow
    if r.agent.command is not None or r.agent.url is not None:
        return "agent"
    return "multi_turn" if is_multi_turn(cfg.data) else "rlvr"


@WORKFLOWS.register("rlvr")
def rlvr_workflow(ctx: WorkflowContext) -> RLVRWorkflow:
    cfg, r = ctx.cfg, ctx.cfg.rollout
    return RLVRWorkflow(
        ctx.client,
        ctx.tokenizer,
        warmed_reward(cfg, ctx.train_data.table[0]),
        ctx.gconfig,
        r.group_size,
        r.reward_timeout_s,
        render=prompt_renderer(cfg, ctx.tokenizer),
        length_penalty=_overlong_penalty(cfg),
    )


def _overlong_penalty(cfg: LLMConfig):
    w, budget = cfg.reward, cfg.rollout.max_new_tokens
    if not w.overlong_buffer:
        return None
    return functools.partial(
        overlong_penalty, max_tokens=budget, buffer=w.overlong_buffer, factor=w.overlong_penalty
    )


@WORKFLOWS.register("multi_turn")
def multi_turn_workflow(ctx: WorkflowContext) -> MultiTurnWorkflow:
    r = ctx.cfg.rollout
    return MultiTurnWorkflow(
        ctx.client,
        ctx.tokenizer,
        TASKS.get(ctx.cfg.data.task).env,
        ctx.gconfig,
        max_turns=r.max_turns,
        turn_discount=r.turn_discount,
        group_size=r.group_size,
    )


@WORKFLOWS.register("agent")
def agent_workflow(ctx: WorkflowContext) -> ExternalAgentWorkflow:
    """An agent command (or service) per episode, against a recording session endpoint."""
    from tidal.inference.sessions import SessionProxy
    from tidal.rollout.agent_command import CommandAgent, ExternalAgentWorkflow, ServiceAgent

    cfg, r = ctx.cfg, ctx.cfg.rollout
    a = r.agent
    agent = (
        CommandAgent(a.command, a.cwd, a.env, a.timeout_s, a.max_processes, a.persistent)
        if a.command is not None
        else ServiceAgent(a.url, a.timeout_s)
    )
    proxy = SessionProxy(ctx.client, ctx.tokenizer, ctx.gconfig, r.tool_parser, a.host)
    return ExternalAgentWorkflow(
        agent,
        proxy,
        ctx.tokenizer,
        group_size=r.group_size,
        mode=r.agent_mode,
        turn_discount=r.turn_discount,
        max_errors=a.max_errors,
        reward=warmed_reward(cfg, None) if a.reward == "config" else None,
        reward_timeout_s=r.reward_timeout_s,
        max_concurrent=r.max_concurrent_rollouts,
    )


def in_process_agent(ctx: WorkflowContext, agent: AgentFn) -> AgentWorkflow:
    """``agent`` (``async def agent(client, data) -> reward``) as the run's workflow, with the
    run's inference client, tokenizer and generation defaults, and rollout.group_size,
    agent_mode, turn_discount and tool_parser."""
    from tidal.rollout.agent_workflow import AgentWorkflow

    r = ctx.cfg.rollout
    return AgentWorkflow(
        agent,
        ctx.client,
        ctx.tokenizer,
        ctx.gconfig,
        group_size=r.group_size,
        mode=r.agent_mode,
        turn_discount=r.turn_discount,
        tool_parser=r.tool_parser,
    )
