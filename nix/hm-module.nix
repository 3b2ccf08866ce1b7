# services.agentsandbox for home-manager: one user's config, their systemd
# user service, git's signing programs on request, and the Claude Code
# drop-in rendered from the same config (installing it needs root: the
# activation prints the one command).
#
# `services.` rather than `programs.`: home-manager names a module after the
# daemon it runs (services.gpg-agent, services.syncthing, services.spotifyd),
# and the heart of this one is the user service; the option names then match
# the NixOS module's, so a settings block moves between the two unchanged.
{
  config,
  lib,
  options,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkEnableOption
    mkIf
    mkOption
    types
    toList
    optionalAttrs
    ;

  cfg = config.services.agentsandbox;
  settingsLib = import ./settings.nix { inherit lib; };
  units = import ./units.nix { inherit lib; };
  tomlFormat = pkgs.formats.toml { };

  settings = settingsLib.clean cfg.settings;
  configFile = tomlFormat.generate "agentsandbox-config.toml" settings;

  home = config.home.homeDirectory;
  configTarget = "${config.xdg.configHome}/agentsandbox/config.toml";
  # Where the loader will find the file, as the drop-in's renderer must see it.
  configPath =
    if lib.hasPrefix "${home}/" configTarget then "~/${lib.removePrefix "${home}/" configTarget}" else configTarget;

  dropIn = import ./dropin.nix {
    inherit (pkgs) runCommand;
    package = cfg.package;
  } { config = configFile; inherit configPath; };
  dropInName = "agentsandbox/managed-settings.d/50-agentsandbox.json";
  managedTarget = "/etc/claude-code/managed-settings.d/50-agentsandbox.json";
  managedBase = "/etc/claude-code/managed-settings.json";
  emptyBase = builtins.toFile "managed-settings.json" "{}\n";

  subst = units.substitute {
    package = cfg.package;
    kill = "${pkgs.coreutils}/bin/kill";
  };
  shipped = units.userService;

  servicePath = lib.concatStringsSep ":" [
    (lib.makeBinPath cfg.path)
    "${config.home.profileDirectory}/bin"
    "/run/wrappers/bin"
    "/etc/profiles/per-user/%u/bin"
    "/run/current-system/sw/bin"
    "/usr/local/bin"
    "/usr/bin"
    "/bin"
  ];

  signing = {
    gpg.program = "${cfg.package}/bin/agentsandbox-gpg";
    gpg.ssh.program = "${cfg.package}/bin/agentsandbox-ssh-sign";
  };
  # programs.git.extraConfig became programs.git.settings in home-manager 25.11.
  gitSettingsOption = if options.programs.git ? settings then "settings" else "extraConfig";
in
{
  options.services.agentsandbox = {
    enable = mkEnableOption "agentsandbox: one policy for AI coding agents (egress proxy, host broker, token keepers) as a systemd user service";

    package = mkOption {
      type = types.package;
      default = pkgs.agentsandbox or (pkgs.callPackage ./package.nix { });
      defaultText = lib.literalExpression "pkgs.agentsandbox or (pkgs.callPackage ./package.nix { })";
      description = "The agentsandbox package. Its renderer renders the drop-in; it runs the service.";
    };

    settings = settingsLib.option {
      inherit tomlFormat;
      description = ''
        Written to {file}`$XDG_CONFIG_HOME/agentsandbox/config.toml`, which wins over
        {file}`/etc/agentsandbox/config.toml`. See docs/config.md for every key. The file is
        in the world-readable Nix store: name token sources, never tokens.
      '';
    };

    path = mkOption {
      type = types.listOf types.package;
      default = with pkgs; [
        git
        gnupg
        openssh
        gh
      ];
      defaultText = lib.literalExpression "with pkgs; [ git gnupg openssh gh ]";
      description = ''
        Programs the service runs (git, gpg and ssh-keygen for signing, gh for the built-in
        GitHub token rule), ahead of the profile directories on its `PATH`.
      '';
    };

    git.signing = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Set git's `gpg.program` and `gpg.ssh.program` (through `programs.git`) to the
        package's signing wrappers: inside a sandbox they sign through the broker, outside it
        they run the real gpg / ssh-keygen.
      '';
    };
  };

  config = mkIf cfg.enable (
    lib.mkMerge [
      {
        assertions = [
          (lib.hm.assertions.assertPlatform "services.agentsandbox" pkgs lib.platforms.linux)
        ]
        ++ map (why: {
          assertion = false;
          message = "services.agentsandbox.settings: ${why} (agentsandbox's config loader refuses this)";
        }) (settingsLib.errors { inherit settings home; });

        warnings =
          map (
            key: "services.agentsandbox.settings.${key} is not a key this module knows; agentsandbox's config loader refuses unknown keys (the drop-in's build will fail on it unless the package is newer than this module)"
          ) (settingsLib.unknownKeys settings)
          ++ lib.optional (cfg.git.signing && !(config.programs.git.enable or false)) "services.agentsandbox.git.signing sets programs.git's config, which has no effect while programs.git.enable is false";

        home.packages = [ cfg.package ];

        xdg.configFile."agentsandbox/config.toml".source = configFile;

        # Root alone may write /etc/claude-code; the rendered file waits here.
        xdg.dataFile.${dropInName}.source = dropIn;

        home.activation.agentsandboxDropIn = lib.hm.dag.entryAfter [ "linkGeneration" ] ''
          if ! cmp -s ${dropIn} ${managedTarget} 2>/dev/null; then
            echo "agentsandbox: ${managedTarget} is not what this configuration renders; install it as root:"
            if [ -e ${managedBase} ]; then
              echo "  sudo install -D -m 0644 ${dropIn} ${managedTarget}"
            else
              echo "  sudo sh -c 'install -D -m 0644 ${dropIn} ${managedTarget} && install -m 0644 ${emptyBase} ${managedBase}'"
            fi
          fi
        '';

        systemd.user.services.agentsandbox = {
          Unit = lib.mapAttrs (_: subst) shipped.Unit // {
            # [broker] and [scope] changes need a restart; the rest reloads live.
            X-Restart-Triggers = [ "${configFile}" ];
          };
          Service = lib.mapAttrs (_: subst) (removeAttrs shipped.Service [ "Environment" ]) // {
            Environment = toList shipped.Service.Environment ++ [ "PATH=${servicePath}" ];
          };
          # home-manager wants the [Install] keys as lists.
          Install = lib.mapAttrs (_: toList) shipped.Install;
        };
      }
      (mkIf cfg.git.signing (optionalAttrs (options ? programs.git) {
        programs.git.${gitSettingsOption} = signing;
      }))
    ]
  );
}
