"""The built-in workflows of ``rollout.workflow``, registered by name: each builds from the
language runner (its config, inference client, tokenizer, generation defaults and data).
``auto`` picks ``agent`` when an agent command or service is configured, else what the data
runs (``multi_turn`` for a multi-turn task, ``rlvr`` otherwise). An agent in tidal's process is
a user's ``rollout.workflow: module.path:factory`` returning ``in_process_agent(runner, agent)``."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from tidal.config.llm import LLMConfig
from tidal.rollout.tasks import TASKS, is_multi_turn
from tidal.rollout.workflows import WORKFLOWS, MultiTurnWorkflow, RLVRWorkflow, overlong_penalty
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
def rlvr_workflow(runner) -> RLVRWorkflow:
    cfg, r = runner.cfg, runner.cfg.rollout
    return RLVRWorkflow(
        runner.client,
        runner.tokenizer,
        warmed_reward(cfg, runner.train_data.table[0]),
        runner.gconfig,
        r.group_size,
        r.reward_timeout_s,
        render=prompt_renderer(cfg, runner.tokenizer),
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
def multi_turn_workflow(runner) -> MultiTurnWorkflow:
    r = runner.cfg.rollout
    return MultiTurnWorkflow(
        runner.client,
        runner.tokenizer,
        TASKS.get(runner.cfg.data.task).env,
        runner.gconfig,
        max_turns=r.max_turns,
        turn_discount=r.turn_discount,
        group_size=r.group_size,
    )


@WORKFLOWS.register("agent")
def agent_workflow(runner) -> ExternalAgentWorkflow:
    """An agent command (or service) per episode, against a recording session endpoint."""
    from tidal.inference.sessions import SessionProxy
    from tidal.rollout.agent_command import CommandAgent, ExternalAgentWorkflow, ServiceAgent

    cfg, r = runner.cfg, runner.cfg.rollout
    a = r.agent
    agent = (
        CommandAgent(a.command, a.cwd, a.env, a.timeout_s)
        if a.command is not None
        else ServiceAgent(a.url, a.timeout_s)
    )
    proxy = SessionProxy(runner.client, runner.tokenizer, runner.gconfig, r.tool_parser, a.host)
    return ExternalAgentWorkflow(
        agent,
        proxy,
        runner.tokenizer,
        group_size=r.group_size,
        mode=r.agent_mode,
        turn_discount=r.turn_discount,
        max_errors=a.max_errors,
        reward=warmed_reward(cfg, None) if a.reward == "config" else None,
        reward_timeout_s=r.reward_timeout_s,
        max_concurrent=r.max_concurrent_rollouts,
    )


def in_process_agent(runner, agent: AgentFn) -> AgentWorkflow:
    """``agent`` (``async def agent(client, data) -> reward``) as the run's workflow, with the
    run's inference client, tokenizer and generation defaults, and rollout.group_size,
    agent_mode, turn_discount and tool_parser."""
    from tidal.rollout.agent_workflow import AgentWorkflow

    r = runner.cfg.rollout
    return AgentWorkflow(
        agent,
        runner.client,
        runner.tokenizer,
        runner.gconfig,
        group_size=r.group_size,
        mode=r.agent_mode,
        turn_discount=r.turn_discount,
        tool_parser=r.tool_parser,
    )
