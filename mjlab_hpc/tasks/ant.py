"""Ant: a four-legged robot learning to run forward on flat ground (contact-rich)."""

from __future__ import annotations

import torch

from mjlab_hpc.tasks.base import EnvConfig, WarpVecEnv

__all__ = ["ANT_CFG", "ANT_XML", "AntEnv"]


def _leg(name: str, x: float, y: float) -> str:
    # One leg: hip (yaw about z) then ankle, both hinges; capsules touch the floor.
    ankle_range = "30 70" if x * y > 0 else "-70 -30"
    return f"""
      <body name="{name}_leg" pos="0 0 0">
        <geom type="capsule" fromto="0 0 0 {x * 0.2:.3f} {y * 0.2:.3f} 0" size="0.08"/>
        <body name="{name}_thigh" pos="{x * 0.2:.3f} {y * 0.2:.3f} 0">
          <joint name="{name}_hip" type="hinge" axis="0 0 1" range="-30 30"/>
          <geom type="capsule" fromto="0 0 0 {x * 0.2:.3f} {y * 0.2:.3f} 0" size="0.08"/>
          <body name="{name}_shin" pos="{x * 0.2:.3f} {y * 0.2:.3f} 0">
            <joint name="{name}_ankle" type="hinge" axis="{-y:.0f} {x:.0f} 0"
                   range="{ankle_range}"/>
            <geom type="capsule" fromto="0 0 0 {x * 0.4:.3f} {y * 0.4:.3f} 0" size="0.08"/>
          </body>
        </body>
      </body>"""


_LEGS = (("front_left", 1, 1), ("front_right", -1, 1), ("back_left", -1, -1), ("back_right", 1, -1))

ANT_XML = f"""
<mujoco model="ant">
  <compiler angle="degree"/>
  <option timestep="0.01" integrator="implicitfast" cone="pyramidal"/>
  <default>
    <joint limited="true" armature="1" damping="1"/>
    <geom condim="3" friction="1 0.5 0.5" density="5.0" margin="0.01"/>
    <motor ctrlrange="-1 1" ctrllimited="true" gear="150"/>
  </default>
  <worldbody>
    <geom name="floor" type="plane" size="0 0 0.05" pos="0 0 0"/>
    <body name="torso" pos="0 0 0.75">
      <freejoint name="root"/>
      <geom name="torso" type="sphere" size="0.25"/>
      {"".join(_leg(n, x, y) for n, x, y in _LEGS)}
    </body>
  </worldbody>
  <actuator>
    {"".join(f'<motor joint="{n}_hip"/><motor joint="{n}_ankle"/>' for n, _, _ in _LEGS)}
  </actuator>
</mujoco>
"""

ANT_CFG = EnvConfig(xml=ANT_XML, decimation=4, episode_length=1000, nconmax=16, njmax=64)

_MIN_Z, _MAX_Z = 0.26, 1.0  # torso height outside this range: the ant fell or flew off
# Per unit of squared control. At 0.5 a random policy pays more for its effort than it earns
# staying up, so PPO learns to fall sooner (docs/performance.md).
_CTRL_COST = 0.1


class AntEnv(WarpVecEnv):
    """Reward forward velocity plus staying healthy, minus control effort."""

    def __init__(self, num_envs: int, device: str, seed: int, use_graph: bool = True) -> None:
        super().__init__(ANT_CFG, num_envs, device, seed, use_graph)

    def _initial_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, nq, nv = self.num_envs, self.mj_model.nq, self.mj_model.nv
        qpos = self.qpos0.expand(n, nq).clone()
        # Noise on the joints only: perturbing the free joint's quaternion would denormalise it.
        qpos[:, 7:] += self._uniform((n, nq - 7), -0.1, 0.1)
        qvel = 0.1 * torch.randn((n, nv), generator=self.generator, device=self.device)
        return qpos, qvel

    def _observations(self) -> torch.Tensor:
        return torch.cat([self.qpos[:, 2:], self.qvel.clamp(-10.0, 10.0)], dim=1)

    def _reward_and_termination(self) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.qpos[:, 2]
        terminated = (z < _MIN_Z) | (z > _MAX_Z)
        forward = self.qvel[:, 0]
        ctrl_cost = _CTRL_COST * self.ctrl.square().sum(dim=1)
        reward = forward + (~terminated).float() - ctrl_cost
        return reward, terminated
