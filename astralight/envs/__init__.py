"""Text-game environments (the AgentBench / ALFWorld kind) for the multi-turn workflows.

- :mod:`astralight.envs.textworld_env`: TextWorld games (generated locally by TextWorld's own
  generator, :func:`~astralight.envs.textworld_env.make_games`) as an
  :class:`~astralight.workflows.multi_turn.Environment`.
- :mod:`astralight.envs.textworld_tasks`: a folder of games as a prompt source (train/eval).
- :mod:`astralight.envs.alfworld_env`: ALFWorld games (``game.tw-pddl`` + ``traj_data.json``
  folders) and their prompt source.
- :mod:`astralight.envs.textworld_warmstart`: scripted chat conversations (the games'
  walkthroughs) for the tiny chat model's warm start.

Each environment is named by import path in a workflow config (``environment:
astralight.envs.textworld_env.TextWorldEnv``); nothing here is imported before it is used, so
TextWorld is only needed where a game is played.
"""
