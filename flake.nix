{
  description = "agentsandbox: run AI coding agents under one policy (Claude Code managed settings, a file-tool hook, an egress proxy, a host broker)";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.05";
    # For checks.hm-activation only; consumers can point it at their own:
    # inputs.agentsandbox.inputs.home-manager.follows = "home-manager".
    home-manager = {
      url = "github:nix-community/home-manager/release-25.05";
      inputs.nixpkgs.follows = "nixpkgs";
    };
  };

  outputs =
    {
      self,
      nixpkgs,
      home-manager,
    }:
    let
      inherit (nixpkgs) lib;
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      # scripts/test-nix checks this flake with a nixpkgs that is its lib/
      # alone (no package tree can be had offline).  The per-system outputs
      # need the package tree; there they are left out, and the script lists
      # them as not checked.
      hasPackageTree = nixpkgs ? legacyPackages;
      forAllSystems =
        f: lib.optionalAttrs hasPackageTree (lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system}));
    in
    {
      overlays.default = final: _prev: {
        agentsandbox = final.callPackage ./nix/package.nix { };
      };

      # Wrapped in `imports` so Nix 2.8's `flake check` accepts them, and error
      # messages keep pointing at the files.
      nixosModules.default = {
        imports = [ ./nix/nixos-module.nix ];
      };
      homeManagerModules.default = {
        imports = [ ./nix/hm-module.nix ];
      };
      # home-manager's newer name for the same output.
      homeModules = self.homeManagerModules;

      packages = forAllSystems (pkgs: {
        default = pkgs.callPackage ./nix/package.nix { };
      });

      checks = forAllSystems (
        pkgs:
        let
          system = pkgs.stdenv.hostPlatform.system;
        in
        {
          package = self.packages.${system}.default;
          vm = pkgs.testers.runNixOSTest (import ./nix/tests/vm.nix { inherit self; });
          hm-activation =
            (home-manager.lib.homeManagerConfiguration {
              inherit pkgs;
              modules = [
                self.homeManagerModules.default
                {
                  home = {
                    username = "alice";
                    homeDirectory = "/home/alice";
                    stateVersion = "25.05";
                  };
                  programs.git.enable = true;
                  services.agentsandbox = {
                    enable = true;
                    package = self.packages.${system}.default;
                    git.signing = true;
                    settings.sandbox = {
                      write = [ "~/src" ];
                      domains = [
                        "github.com"
                        "*.example.org"
                      ];
                    };
                  };
                }
              ];
            }).activationPackage;
        }
      );

      formatter = forAllSystems (pkgs: pkgs.nixfmt-rfc-style);

      devShells = forAllSystems (pkgs: {
        default = pkgs.mkShell {
          inputsFrom = [ self.packages.${pkgs.stdenv.hostPlatform.system}.default ];
          packages = [
            pkgs.ruff
            pkgs.mypy
            pkgs.nixfmt-rfc-style
          ];
        };
      });
    };
}
