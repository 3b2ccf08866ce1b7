# The Claude Code drop-in, rendered at build time by the package's own
# renderer (`agentsandbox render claude`), never restated in Nix.
#
# The renderer reads its environment: home paths come out as `~/…` (so any
# build-time HOME gives the same file), the runtime dir as `//run/user/*/…`
# (any /run/user/N does), and the hooks' command is AGENTSANDBOX_EXE (the
# PreToolUse hook runs the package's Python on its hookstart.py, handing it
# AGENTSANDBOX_EXE: both are store paths, so every user gets them).  The one
# thing that matters is where the config will live on the target machine: a
# config under home (home-manager's ~/.config/agentsandbox/config.toml) is
# itself re-allowed for reading, one in /etc is not.  So `configPath` names
# that place, and a `~/` one is laid down under the build's HOME, exactly
# where `agentsandbox install` run by the user would find it.
#
# A config the loader refuses fails this build with the loader's own message.
{ runCommand, package }:
{
  config,
  configPath ? "/etc/agentsandbox/config.toml",
}:
let
  inHome = builtins.substring 0 2 configPath == "~/";
  rel = builtins.substring 2 (builtins.stringLength configPath) configPath;
in
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
    ${
      if inHome then
        ''
          target="$HOME/${rel}"
          mkdir -p "$(dirname "$target")"
          cp ${config} "$target"
        ''
      else
        ''
          target=${config}
        ''
    }
    ${package}/bin/agentsandbox render claude --config "$target" > "$out"
  ''
