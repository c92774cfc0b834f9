"""Cartpole balance: keep a pole upright by pushing its cart. The default, embedded task."""

from __future__ import annotations

import torch

from mjlab_hpc.tasks.base import EnvConfig, WarpVecEnv

__all__ = ["CARTPOLE_CFG", "CARTPOLE_XML", "CartpoleEnv"]


CARTPOLE_XML = """
<mujoco model="cartpole">
  <option timestep="0.01" integrator="implicitfast"/>
  <default>
    <joint damping="0.05"/>
    <geom contype="0" conaffinity="0"/>
  </default>
  <worldbody>
    <body name="cart" pos="0 0 1">
      <joint name="slider" type="slide" axis="1 0 0"/>
      <geom name="cart" type="box" size="0.2 0.15 0.1" mass="1"/>
      <body name="pole">
        <joint name="hinge" type="hinge" axis="0 1 0"/>
        <geom name="pole" type="capsule" fromto="0 0 0 0 0 1" size="0.045" mass="0.1"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor name="push" joint="slider" gear="10" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""

CARTPOLE_CFG = EnvConfig(xml=CARTPOLE_XML, decimation=2, episode_length=500)

_MAX_ANGLE = 0.4  # rad: the pole has fallen
_MAX_CART = 2.4  # m: the cart left the track


class CartpoleEnv(WarpVecEnv):
    """Reward 1 per step upright; the episode ends when the pole falls or the cart leaves."""

    def __init__(self, num_envs: int, device: str, seed: int, use_graph: bool = True) -> None:
        super().__init__(CARTPOLE_CFG, num_envs, device, seed, use_graph)

    def _initial_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_envs
        return self._uniform((n, 2), -0.1, 0.1), self._uniform((n, 2), -0.05, 0.05)

    def _observations(self) -> torch.Tensor:
        angle = self.qpos[:, 1:2]
        return torch.cat([self.qpos[:, 0:1], torch.cos(angle), torch.sin(angle), self.qvel], dim=1)

    def _reward_and_termination(self) -> tuple[torch.Tensor, torch.Tensor]:
        terminated = (self.qpos[:, 1].abs() > _MAX_ANGLE) | (self.qpos[:, 0].abs() > _MAX_CART)
        reward = (~terminated).float()
        return reward, terminated
