"""CleanRL's PPO (ppo.py, classic control) on CartPole with 8 envs, recorded.

The recorder is two lines, marked `# recorder`; the rest is CleanRL's loop, with argparse
for its tyro arguments. Usage: python examples/cleanrl_ppo.py [--total-timesteps 100000]
[--target HOST:PORT] (without a target the recorder starts a private local server).
"""

import argparse
import random
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

from recorder_client import RolloutRecorder
from recorder_client.gymnasium import RecordRollouts

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--env-id", default="CartPole-v1")
parser.add_argument("--total-timesteps", type=int, default=100_000)
parser.add_argument("--learning-rate", type=float, default=2.5e-4)
parser.add_argument("--num-envs", type=int, default=8)
parser.add_argument("--num-steps", type=int, default=128)
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--gae-lambda", type=float, default=0.95)
parser.add_argument("--num-minibatches", type=int, default=4)
parser.add_argument("--update-epochs", type=int, default=4)
parser.add_argument("--clip-coef", type=float, default=0.2)
parser.add_argument("--ent-coef", type=float, default=0.01)
parser.add_argument("--vf-coef", type=float, default=0.5)
parser.add_argument("--max-grad-norm", type=float, default=0.5)
parser.add_argument("--target", default=None, help="the recorder server (default: a local one)")
args = parser.parse_args()
args.batch_size = args.num_envs * args.num_steps
args.minibatch_size = args.batch_size // args.num_minibatches
args.num_iterations = args.total_timesteps // args.batch_size


def make_env(env_id):
    def thunk():
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


def layer_init(layer, std=2**0.5, bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs):
        super().__init__()
        n_obs = np.array(envs.single_observation_space.shape).prod()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )  # fmt: skip
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, envs.single_action_space.n), std=0.01),
        )  # fmt: skip

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)
torch.backends.cudnn.deterministic = True
device = torch.device("cpu")

envs = gym.vector.SyncVectorEnv([make_env(args.env_id) for _ in range(args.num_envs)])
recorder = RolloutRecorder(target=args.target, session="cleanrl-ppo", sender="process")  # recorder
envs = RecordRollouts(envs, recorder)  # recorder: every step, next-step autoreset handled
agent = Agent(envs).to(device)
optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape)
actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape)
logprobs, rewards, dones, values = (torch.zeros((args.num_steps, args.num_envs)) for _ in "1234")

global_step, start_time, episodic_returns = 0, time.time(), []
next_obs, _ = envs.reset(seed=args.seed)
next_obs, next_done = torch.Tensor(next_obs), torch.zeros(args.num_envs)
for iteration in range(1, args.num_iterations + 1):
    frac = 1.0 - (iteration - 1.0) / args.num_iterations
    optimizer.param_groups[0]["lr"] = frac * args.learning_rate
    for step in range(args.num_steps):
        global_step += args.num_envs
        obs[step], dones[step] = next_obs, next_done
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step] = value.flatten()
        actions[step], logprobs[step] = action, logprob
        next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
        next_done = np.logical_or(terminations, truncations)
        rewards[step] = torch.tensor(reward).view(-1)
        next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(next_done)
        if "_episode" in infos:
            episodic_returns += infos["episode"]["r"][infos["_episode"]].tolist()

    with torch.no_grad():  # bootstrap value if not done; GAE
        next_value = agent.get_value(next_obs).reshape(1, -1)
        advantages, lastgaelam = torch.zeros_like(rewards), 0
        for t in reversed(range(args.num_steps)):
            if t == args.num_steps - 1:
                nextnonterminal, nextvalues = 1.0 - next_done, next_value
            else:
                nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
            delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
            lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            advantages[t] = lastgaelam
        returns = advantages + values

    b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
    b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1)
    b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
    b_values = values.reshape(-1)
    b_inds = np.arange(args.batch_size)
    for _epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, args.batch_size, args.minibatch_size):
            mb = b_inds[start : start + args.minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                b_obs[mb], b_actions.long()[mb]
            )
            ratio = (newlogprob - b_logprobs[mb]).exp()
            mb_adv = b_advantages[mb]
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss1 = -mb_adv * ratio
            pg_loss2 = -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()
            newvalue = newvalue.view(-1)
            v_clipped = b_values[mb] + torch.clamp(
                newvalue - b_values[mb], -args.clip_coef, args.clip_coef
            )
            v_loss_max = torch.max(
                (newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2
            )
            v_loss = 0.5 * v_loss_max.mean()
            loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
    sps = int(global_step / (time.time() - start_time))
    print(f"iteration {iteration}: step {global_step}, {sps} steps/s, loss {loss.item():.3f}")

envs.close()  # records the last buffered steps and flushes the recorder
traj = recorder.finish()
recorder.close()
recorded = traj.rewards.sum(axis=1)[traj.episode_done]
print(f"env: {len(episodic_returns)} episodes, mean return {np.mean(episodic_returns):.2f}")
print(f"recorded: {len(recorded)} episodes, mean return {recorded.mean():.2f}")
