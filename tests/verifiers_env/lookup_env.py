"""A one-tool verifiers environment, as a verifiers user writes one: look a key up, answer with its value.

The taskset of ``tests/verifiers_recipe.py``, imported by ``vf-eval`` in the
verifiers venv (``lookup_env``), never by the main environment. Its toolset
is taskset-scoped: verifiers starts it once per eval, as ``python -m
lookup_env`` (a task-scoped one would cost a second server start, ~7 s of
imports, per rollout). Each task is named by its key, which is how an
episode selects it (``--select.include.names``).
"""

import verifiers.v1 as vf

VALUES = {"alpha": "42", "beta": "7"}


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is advertised as `lookup`, not `lookup_toolset_lookup`

    @vf.tool
    def lookup(self, key: str) -> str:
        """The value stored under a key."""
        return VALUES.get(key, "unknown")


class LookupData(vf.TaskData):
    answer: str


class LookupTask(vf.Task[LookupData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip().endswith(f" is {self.data.answer}."))


class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [LookupToolset(vf.SharedToolsetConfig())]

    def load(self):
        for key, value in VALUES.items():
            yield LookupTask(LookupData(name=key, prompt=f"What is the value of {key}? Use the lookup tool.",
                                        answer=value), self.config.task)


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    LookupToolset.run()
