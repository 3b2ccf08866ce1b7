# The machine's Claude Code drop-in, rendered at build time by the package's
# own renderer (`agentsandbox render claude --config`), never restated in Nix.
#
# It is rendered from the machine's config alone (the file the NixOS module
# installs as /etc/agentsandbox/config.toml), never from a user's: it serves
# every user of the machine.  It names the package's policy helper
# (`policyHelper.path` = ${package}/bin/agentsandbox-policy-helper), which
# Claude Code runs as each session's user; the helper's output, rendered from
# that user's effective config (the machine's narrowed by their own
# ~/.config/agentsandbox/config.toml), replaces the managed files' settings
# for that session.  That is how a user's own config reaches their sessions.
#
# The renderer reads its environment, and this derivation fixes it: home paths
# come out as `~/…` (so any build-time HOME gives the same file), the runtime
# dir as `//run/user/*/…` (any /run/user/N does), and the hooks' command and
# the helper's directory follow AGENTSANDBOX_EXE (the PreToolUse hook runs the
# package's Python on its hookstart.py, handing it AGENTSANDBOX_EXE: all store
# paths, so every user gets them).  The build's HOME holds no config, and the
# variables that could point the renderer at one are unset.
#
# A config the loader refuses fails this build with the loader's own message.
{ runCommand, package }:
{ config }:
runCommand "50-agentsandbox.json"
  {
    # Text only: nothing here is fetched, so there is nothing to substitute.
    preferLocalBuild = true;
    allowSubstitutes = false;
  }
  ''
    export HOME="$TMPDIR/home"
    export XDG_RUNTIME_DIR=/run/user/65534
    export AGENTSANDBOX_EXE=${package}/bin/agentsandbox
    unset XDG_CONFIG_HOME XDG_STATE_HOME CLAUDE_CONFIG_DIR AGENTSANDBOX_CONFIG
    ${package}/bin/agentsandbox render claude --config ${config} > "$out"
  ''
