"""megasweep's Hydra launchers and the machinery they share.

`launchers.compose` composes thousands of sweep configs without one full Hydra compose
each; `launchers.plan` is the dry-run launcher (`hydra/launcher=plan`). The classes Hydra
instantiates are thin subclasses in `hydra_plugins/megasweep/`, because Hydra only accepts
plugins defined in the `hydra_plugins` namespace package.

Nothing here imports torch: launchers run on login nodes where torch may be absent.
"""
